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
#error "compile with -DPK_SWEEP_INDEX=<0..8>"
#endif

namespace {

using pk::ring_attention::FwdTile;

template <int kHeadDim, int kKeys, int kStages, bool kLazy = false, bool kUnderQk = false,
          bool kDoubleP = false, bool kPersistent = false>
struct Entry {
  using Kernel = pk::ring_attention::AttentionKernel<
      cutlass::bfloat16_t, kHeadDim, false,
      FwdTile<kHeadDim, kKeys, kStages, kLazy, kUnderQk, kDoubleP, kPersistent>>;
  static constexpr int head_dim = kHeadDim;
  // What one CTA may hold (the H200's 227 KiB of shared memory per block).
  static_assert(Kernel::Kernel::SharedStorageSize <= 227 * 1024, "tile too large");
};

// The sweep's configurations, in the order main.cu prints them (one a line:
// tools/sweep.sh counts them; a shape's rows follow this order): each form
// the ops run, and at head dims 128 and 64 the same with P in one register
// buffer or two (FwdTile's kDoubleP; at d64 x 192 keys ptxas serializes its
// wgmma and at d256 x 80 keys it spills, so neither has it). Measured and
// dropped (NOTES.md, 2026-12-05, 2026-12-07): 4 stages, 176 and 192 keys at
// head dim 128 (176 keys with the lazy rescale as well), 64 and 96 keys at
// head dim 256; d64 x 256 keys spills 144 bytes.
using Configs = std::tuple<
    Entry<128, 128, 5, false, true, true>,
    Entry<128, 128, 5, false, true>,
    Entry<128, 128, 5, true, true, true>,
    Entry<128, 128, 5, true, true>,
    Entry<64, 128, 5>,
    Entry<64, 128, 5, false, false, true>,
    Entry<64, 192, 5, false, true>,
    Entry<256, 80, 4, false, true>,
    Entry<128, 128, 5, true, true, true, true>>;
constexpr const char* kNames[] = {
    "d128 128 keys 5 stages two P buffers",
    "d128 128 keys 5 stages one P buffer, rescale under QK",
    "d128 128 keys 5 stages lazy rescale two P buffers (ops)",
    "d128 128 keys 5 stages lazy rescale one P buffer, under QK",
    "d64 128 keys 5 stages (ops: short chunks)",
    "d64 128 keys 5 stages two P buffers",
    "d64 192 keys 5 stages rescale under QK (ops: long chunks)",
    "d256 80 keys 4 stages rescale under QK (ops)",
    "d128 128 keys 5 stages lazy rescale two P buffers, persistent CTAs (ops: a ring of one, "
    "up to 2048 tokens)"};
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
