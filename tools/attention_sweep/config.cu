// One configuration of the fused ring attention kernel's forward for
// tools/attention_sweep, picked by -DPK_SWEEP_INDEX=i (each its own
// translation unit, so they compile in parallel): head dim, keys per tile,
// K/V pipeline stages and mainloop variant (lazy rescale of O, O's rescale
// under the next QK GEMM) of AttentionKernel
// (attention_sm90.cuh: FwdTile), bf16, mechanism copy_engine, run on a ring
// of one. Key tiles of 176 and 80 need cute's extended wgmma shapes (else
// cute tiles them with 16-wide wgmma; AttentionKernel refuses that), so
// they are enabled before any cute header.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <iterator>
#include <tuple>

#include "kernels/ring_attention/attention_sm90.cuh"
#include "tools/attention_sweep/sweep.h"

#ifndef PK_SWEEP_INDEX
#error "compile with -DPK_SWEEP_INDEX=<0..11>"
#endif

namespace {

using pk::ring_attention::FwdTile;

template <int kHeadDim, int kKeys, int kStages, bool kLazy = false, bool kUnderQk = false>
struct Entry {
  using Kernel = pk::ring_attention::AttentionKernel<
      cutlass::bfloat16_t, kHeadDim, false,
      FwdTile<kHeadDim, kKeys, kStages, kLazy, kUnderQk>>;
  static constexpr int head_dim = kHeadDim;
  // What one CTA may hold (the H200's 227 KiB of shared memory per block).
  static_assert(Kernel::Kernel::SharedStorageSize <= 227 * 1024, "tile too large");
};

// The sweep's configurations, in the order main.cu prints them (one a line:
// tools/sweep.sh counts them; a shape's rows follow this order). ptxas (nvcc 13.0) spills 24 bytes in
// d256 x 96 keys (measured all the same); d64 x 256 keys is left out: it
// spills 144 bytes and ptxas serializes its wgmma (too few registers).
using Configs = std::tuple<
    Entry<128, 128, 5>,
    Entry<128, 128, 5, false, true>,
    Entry<128, 128, 4, false, true>,
    Entry<128, 176, 4, false, true>,
    Entry<128, 192, 4, false, true>,
    Entry<128, 128, 5, true, true>,
    Entry<64, 128, 5>,
    Entry<64, 128, 5, false, true>,
    Entry<64, 192, 5, false, true>,
    Entry<256, 64, 4, false, true>,
    Entry<256, 80, 4, false, true>,
    Entry<256, 96, 3, false, true>>;
constexpr const char* kNames[] = {
    "d128 128 keys 5 stages",
    "d128 128 keys 5 stages rescale under QK (ops: no mask)",
    "d128 128 keys 4 stages rescale under QK",
    "d128 176 keys 4 stages rescale under QK",
    "d128 192 keys 4 stages rescale under QK",
    "d128 128 keys 5 stages lazy rescale under QK (ops: causal)",
    "d64 128 keys 5 stages (ops: short chunks)",
    "d64 128 keys 5 stages rescale under QK",
    "d64 192 keys 5 stages rescale under QK (ops: long chunks)",
    "d256 64 keys 4 stages rescale under QK",
    "d256 80 keys 4 stages rescale under QK",
    "d256 96 keys 3 stages rescale under QK"};
static_assert(std::tuple_size_v<Configs> == std::size(kNames));
static_assert(PK_SWEEP_INDEX >= 0 && PK_SWEEP_INDEX < std::tuple_size_v<Configs>,
              "PK_SWEEP_INDEX out of range");
using This = std::tuple_element_t<PK_SWEEP_INDEX, Configs>;

cudaError_t load() { return pk::fmha_launch::load_kernel<typename This::Kernel::Kernel>(); }

cudaError_t run(const pk::ring_attention::Params& p) {
  // A ring of one: no peers' blocks (the kernel points their descriptors at ours).
  const pk::ring_attention::KernelArgs a{&p, p.k, p.v, pk::ring_attention::PushArgs{}};
  return This::Kernel::launch(a);
}

[[maybe_unused]] const bool registered =
    pk_sweep::add({PK_SWEEP_INDEX, kNames[PK_SWEEP_INDEX], This::head_dim, load, run});

}  // namespace
