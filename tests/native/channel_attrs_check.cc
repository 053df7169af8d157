// Host-only check of the `channel` attribute every collective handler binds:
// a CPU FFI handler that decodes it into pk::ffi_common::ChannelAttrs (the
// registration in xla_ffi/ffi_common.h) and returns the members it read.
// Built and run through JAX on CPU by channel_attrs_check.py.
#include "xla_ffi/ffi_common.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Impl(ffi::Buffer<ffi::S64> x, ffi::ResultBuffer<ffi::S64> out,
                       pk::ffi_common::ChannelAttrs c, int32_t extra) {
  int64_t* o = out->typed_data();
  int64_t sum = 0;
  for (size_t i = 0; i < c.group_ids.size(); ++i) sum += c.group_ids[i] * int64_t(i + 1);
  o[0] = int64_t(c.group_ids.size());
  o[1] = sum;
  o[2] = c.group_size;
  o[3] = c.slot;
  o[4] = c.data_offset;
  o[5] = c.data_bytes;
  o[6] = c.timeout_ns;
  o[7] = c.skip_post_rank;
  o[8] = extra;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChannelCheck, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S64>>()
                                  .Ret<ffi::Buffer<ffi::S64>>()
                                  .Attr<pk::ffi_common::ChannelAttrs>("channel")
                                  .Attr<int32_t>("extra"));
