// The pk_jax native extension: FFI handler capsules and runtime controls.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "kernels/all_gather/all_gather.h"
#include "kernels/attention_bwd/attention_bwd.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ring_attention/ring_attention.h"
#include "kernels/tp_matmul/tp_matmul.h"
#include "pk/signals.h"
#include "runtime/workspace.h"
#include "xla_ffi/handlers.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule as_capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

void raise_if(const std::string& err) {
  if (!err.empty()) throw std::runtime_error(err);
}

// Every kernel the extension launches, loaded on each device at init.
const std::vector<pk::runtime::KernelLoader>& kernel_loaders() {
  static const std::vector<pk::runtime::KernelLoader> loaders = {
      pk::signals::load_kernels,        pk::all_gather::load_kernels,
      pk::gemm::load_kernels,           pk::tp_matmul::load_kernels,
      pk::ring_attention::load_kernels, pk::attention_bwd::load_kernels,
  };
  return loaders;
}

}  // namespace

NB_MODULE(_pk_jax_ext, m) {
  m.doc() = "pk_jax CUDA kernels registered as XLA FFI handlers";

  m.def("registrations", []() {
    nb::dict d;
    d["pk_all_gather"] = as_capsule(pk::ffi_handlers::AllGather);
    d["pk_all_gather_matmul"] = as_capsule(pk::ffi_handlers::AllGatherMatmul);
    d["pk_matmul_reduce_scatter"] = as_capsule(pk::ffi_handlers::MatmulReduceScatter);
    d["pk_ring_attention"] = as_capsule(pk::ffi_handlers::RingAttention);
    d["pk_attention_block_bwd"] = as_capsule(pk::ffi_handlers::AttentionBlockBwd);
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");

  m.def("init_runtime",
        [](const std::vector<std::pair<int64_t, int>>& devices, size_t data_bytes) {
          raise_if(pk::runtime::Runtime::get().init(devices, data_bytes, kernel_loaders()));
        },
        nb::arg("devices"), nb::arg("data_bytes"),
        "Allocate and peer-map the workspace of every (global id, local ordinal) and "
        "load every kernel there.");

  m.def("initialized", []() { return pk::runtime::Runtime::get().initialized(); });
  m.def("data_bytes", []() { return pk::runtime::Runtime::get().data_bytes(); });

  m.def("pending_errors", []() {
    std::vector<std::string> out;
    for (const auto& e : pk::runtime::Runtime::get().pending_errors())
      out.push_back(pk::runtime::describe(e.record, e.ordinal));
    return out;
  }, "Descriptions of the errors kernels recorded and nobody cleared yet.");

  m.def("reset", []() { raise_if(pk::runtime::Runtime::get().reset()); },
        "Wait for every device, then zero every flag, line and error record.");

  m.attr("max_ranks") = pk::kMaxRanks;
  m.attr("max_slots") = pk::kMaxSlots;
  m.attr("data_offset") = pk::kDataOffset;
  m.attr("ll_max_bytes") = pk::kLlMaxBytes;
  m.attr("ll_channels") = pk::kLlChannels;
  m.attr("has_gemm") = pk::gemm::available();
  m.attr("has_attention") = pk::ring_attention::available();
}
