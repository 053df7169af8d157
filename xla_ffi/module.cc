// The pk_jax native extension: FFI handler capsules and runtime controls.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <string>

#include "kernels/all_gather/all_gather.h"
#include "kernels/all_reduce/all_reduce.h"
#include "kernels/moe/moe.h"
#include "kernels/attention_bwd/attention_bwd.h"
#include "kernels/fp8/fp8.h"
#include "kernels/gemm/gemm.h"
#include "kernels/grouped_matmul/grouped_matmul.h"
#include "kernels/ring_attention/ring_attention.h"
#include "kernels/ring_attention_bwd/ring_attention_bwd.h"
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
      pk::ring_attention_bwd::load_kernels,
      pk::all_reduce::load_kernels,
      pk::moe::load_kernels,            pk::moe::load_local_kernels,
      pk::moe::load_layout_kernels,
      pk::grouped_matmul::load_kernels,
      pk::fp8::load_kernels,
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
    d["pk_all_gather_matmul_bwd"] = as_capsule(pk::ffi_handlers::AllGatherMatmulBwd);
    d["pk_matmul_reduce_scatter_bwd"] = as_capsule(pk::ffi_handlers::MatmulReduceScatterBwd);
    d["pk_matmul_all_reduce"] = as_capsule(pk::ffi_handlers::MatmulAllReduce);
    d["pk_all_gather_matmul_fp8"] = as_capsule(pk::ffi_handlers::AllGatherMatmulFp8);
    d["pk_matmul_reduce_scatter_fp8"] = as_capsule(pk::ffi_handlers::MatmulReduceScatterFp8);
    d["pk_matmul_all_reduce_fp8"] = as_capsule(pk::ffi_handlers::MatmulAllReduceFp8);
    d["pk_ring_attention"] = as_capsule(pk::ffi_handlers::RingAttention);
    d["pk_attention_block_bwd"] = as_capsule(pk::ffi_handlers::AttentionBlockBwd);
    d["pk_grouped_matmul"] = as_capsule(pk::ffi_handlers::GroupedMatmul);
    d["pk_ring_attention_bwd"] = as_capsule(pk::ffi_handlers::RingAttentionBwd);
    d["pk_all_reduce"] = as_capsule(pk::ffi_handlers::AllReduce);
    d["pk_moe_exchange"] = as_capsule(pk::ffi_handlers::MoeExchange);
    d["pk_moe_scatter_rows"] = as_capsule(pk::ffi_handlers::MoeScatterRows);
    d["pk_moe_weighted_sum"] = as_capsule(pk::ffi_handlers::MoeWeightedSum);
    d["pk_moe_layout"] = as_capsule(pk::ffi_handlers::MoeLayout);
    d["pk_fp8_quantize"] = as_capsule(pk::ffi_handlers::Fp8Quantize);
    d["pk_fp8_matmul"] = as_capsule(pk::ffi_handlers::Fp8Matmul);
    return d;
  }, "FFI target name -> handler capsule, for jax.ffi.register_ffi_target.");

  // Every call that can wait on a device or load kernels runs without the
  // GIL (other Python threads, JAX's among them, go on meanwhile); arguments
  // are converted before and the message is raised after.
  m.def("init_runtime",
        [](const std::vector<std::pair<int64_t, int>>& devices, size_t data_bytes) {
          std::string err;
          {
            nb::gil_scoped_release unlocked;
            err = pk::runtime::Runtime::get().init(devices, data_bytes, kernel_loaders());
          }
          raise_if(err);
        },
        nb::arg("devices"), nb::arg("data_bytes"),
        "Allocate the workspace of every (JAX device id, local CUDA ordinal) so that it can be "
        "exported to other processes, zero its flags, create streams and events and load every "
        "kernel there. Enables no peer access (connect_group does). On failure frees what it "
        "allocated, stays uninitialized and raises; a later call may retry. A second call after "
        "a success is a no-op with the same arguments and raises otherwise.");

  m.def("initialized", []() { return pk::runtime::Runtime::get().initialized(); });
  m.def("data_bytes", []() { return pk::runtime::Runtime::get().data_bytes(); });

  m.def("device_info", [](int ordinal) {
    pk::runtime::DeviceInfo info;
    raise_if(pk::runtime::Runtime::device_info(ordinal, &info));
    nb::dict d;
    d["pci_bus_id"] = info.pci_bus_id;
    d["compute_capability"] = nb::make_tuple(info.major, info.minor);
    d["supported"] = info.supported;
    d["ipc"] = info.ipc;
    return d;
  }, nb::arg("ordinal"),
     "{'pci_bus_id': str, 'compute_capability': (major, minor), 'supported': bool (sm_90, what "
     "the kernels are built for), 'ipc': bool (CUDA IPC available)} of a visible CUDA device. "
     "Needs no init and allocates nothing.");

  m.def("export_workspace", [](int ordinal) {
    std::string handle;
    raise_if(pk::runtime::Runtime::get().export_workspace(ordinal, &handle));
    return nb::bytes(handle.data(), handle.size());
  }, nb::arg("ordinal"),
     "The CUDA IPC handle (64 bytes) of local device `ordinal`'s workspace, for import_peer in "
     "the other processes of this host.");

  m.def("import_peer",
        [](int64_t global_id, nb::bytes handle, const std::string& pci_bus_id,
           int64_t data_bytes) {
          raise_if(pk::runtime::Runtime::get().import_peer(
              global_id, std::string(handle.c_str(), handle.size()), pci_bus_id, data_bytes));
        },
        nb::arg("global_id"), nb::arg("handle"), nb::arg("pci_bus_id"),
        nb::arg("data_bytes") = -1,
        "Register JAX device `global_id`, driven by another process of this host, by its "
        "exported workspace handle and its GPU's PCI bus id (device_info there). Maps nothing "
        "yet: connect_group maps it on the local devices that share a group with it. "
        "Idempotent for the same arguments; raises for the same id with another handle, for a "
        "local device's id, and when `data_bytes` (the peer's data_bytes(); -1: unchecked) "
        "differs from ours.");

  m.def("connect_group",
        [](const std::vector<int64_t>& global_ids) {
          std::string err;
          {
            nb::gil_scoped_release unlocked;
            err = pk::runtime::Runtime::get().connect_group(global_ids);
          }
          raise_if(err);
        },
        nb::arg("global_ids"),
        "Make every member of one group (JAX device ids, rank order) reachable from each of its "
        "local members: peer access between local GPUs, imported workspaces mapped on each local "
        "member. Raises naming both devices when a pair has no peer-to-peer path, or for an id "
        "neither local nor imported. A row without local members does nothing. Cheap on "
        "repeats. Call at lowering, for every group row that holds a local device, before its "
        "kernels run.");

  m.def("can_access", [](int ordinal, const std::string& pci_bus_id) {
    bool can = false;
    raise_if(pk::runtime::Runtime::can_access(ordinal, pci_bus_id, &can));
    return can;
  }, nb::arg("ordinal"), nb::arg("pci_bus_id"),
     "Whether visible CUDA device `ordinal` can read and write the GPU at `pci_bus_id` "
     "directly (the same GPU: True). Needs no init. For a GPU CUDA does not show this process "
     "NVML answers; where it cannot, True (connect_group then tells for sure).");

  m.def("pending_errors", []() {
    std::vector<std::string> out;
    for (const auto& e : pk::runtime::Runtime::get().pending_errors())
      out.push_back(pk::runtime::describe(e.record, e.ordinal));
    return out;
  }, "Descriptions of the errors kernels recorded and nobody cleared yet.");

  m.def("synchronize",
        [](double timeout_s) {
          std::string err;
          {
            nb::gil_scoped_release unlocked;
            err = pk::runtime::Runtime::get().synchronize(timeout_s);
          }
          raise_if(err);
        },
        nb::arg("timeout_s") = 60.0,
        "Wait until every local device finished all its work (XLA's included), at most "
        "`timeout_s` seconds; raises naming the devices that did not finish or failed. After a "
        "timeout a background thread keeps waiting for the late device. No-op before init.");

  m.def("reset",
        [](double timeout_s) {
          std::string err;
          {
            nb::gil_scoped_release unlocked;
            err = pk::runtime::Runtime::get().reset(timeout_s);
          }
          raise_if(err);
        },
        nb::arg("timeout_s") = 60.0,
        "synchronize(timeout_s), then zero every flag, line and error record of this process's "
        "devices. A device that did not finish or has a CUDA error is left as it was and named "
        "in the raised message; the others are reset all the same. With peers in other "
        "processes every process must reset before any of them runs a pk_jax op again.");

  m.attr("max_ranks") = pk::kMaxRanks;
  m.attr("max_slots") = pk::kMaxSlots;
  m.attr("data_offset") = pk::kDataOffset;
  m.attr("ll_max_bytes") = pk::kLlMaxBytes;
  m.attr("ll_channels") = pk::kLlChannels;
  m.attr("has_gemm") = pk::gemm::available();
  m.def("cublaslt_version", &pk::gemm::cublaslt_version,
        "cuBLASLt's version where the per-tensor FP8 GEMMs can run it (built with its header, "
        "the library loaded at the runtime's init), else 0.");
  m.attr("has_attention") = pk::ring_attention::available();
}
