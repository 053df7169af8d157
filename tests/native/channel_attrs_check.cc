// Host-only check of the `channel` attribute every collective handler binds:
// a CPU FFI handler that decodes it into pk::ffi_common::ChannelAttrs (the
// registration in xla_ffi/ffi_common.h) and returns the members it read, each
// as two 32-bit words (low, high), so the test needs no 64-bit JAX types.
// Built and run through JAX on CPU by tests/test_ffi_attrs_cpu.py.
#include "xla_ffi/ffi_common.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Impl(ffi::Buffer<ffi::U32> x, ffi::ResultBuffer<ffi::U32> out,
                pk::ffi_common::ChannelAttrs c, int32_t extra) {
  (void)x;
  int64_t sum = 0;  // group_ids weighted by position: order and values
  for (size_t i = 0; i < c.group_ids.size(); ++i) sum += c.group_ids[i] * int64_t(i + 1);
  const int64_t values[9] = {int64_t(c.group_ids.size()), sum, c.group_size, c.slot,
                             c.data_offset, c.data_bytes, c.timeout_ns, c.skip_post_rank,
                             extra};
  uint32_t* o = out->typed_data();
  for (int i = 0; i < 9; ++i) {
    o[2 * i] = uint32_t(uint64_t(values[i]));
    o[2 * i + 1] = uint32_t(uint64_t(values[i]) >> 32);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChannelCheck, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>()
                                  .Attr<pk::ffi_common::ChannelAttrs>("channel")
                                  .Attr<int32_t>("extra"));
