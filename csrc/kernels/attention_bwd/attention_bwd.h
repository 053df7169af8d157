// Flash-attention backward of one (query block, K/V block) pair of the ring:
// the gradient contributions of one ring step.
//
// Inputs (this rank's queries, one visiting K/V block):
//   q, dout [B, S, Hq, D] (bf16 or fp16), lse and delta [B, Hq, S] (fp32;
//   lse in natural log of the scaled scores, delta = rowsum(dout * out) - dlse),
//   k, v [B, T, Hkv, D], q_rank and k_rank (int32 scalars in device memory:
//   the ranks that own the query block and the K/V block; read on the device,
//   so a traced ring step needs no host round trip).
// Outputs: dq [B, S, Hq, D] fp32 (zeroed here, then accumulated by TMA
//   reduce-adds from every K/V tile: the order of those fp32 adds varies from
//   run to run, so dq is not bit-reproducible), dk and dv [B, T, Hkv, D]
//   (summed over the query heads of each GQA group in registers and stored
//   once: deterministic), fp32 or the input type (dkv_in_input_type: a
//   block whose dK/dV need no further sum, a ring of one).
// Masks: causal compares global token positions (kv_walk.cuh's Geometry,
//   the forward's definition: contiguous or zigzag over a ring of n).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.h"

namespace pk::attention_bwd {

using pk::DType;  // bf16 or fp16

// K/V rows per CTA (two math warpgroups of 64).
inline constexpr int kTileKv = 128;
// Query rows per inner tile: CUTLASS's example picks 64 for head dim 128
// (shared memory) and 128 for head dim 64.
inline constexpr int tile_q(int head_dim) { return head_dim == 128 ? 64 : 128; }

struct Params {
  const void* q = nullptr;      // [B, S, Hq, D]
  const void* dout = nullptr;   // [B, S, Hq, D]
  const float* lse = nullptr;   // [B, Hq, S]
  const float* delta = nullptr; // [B, Hq, S]
  const void* k = nullptr;      // [B, T, Hkv, D]
  const void* v = nullptr;
  const int32_t* q_rank = nullptr;  // device scalars
  const int32_t* k_rank = nullptr;
  float* dq = nullptr;          // [B, S, Hq, D]
  // Add this block's dq to what dq holds (no zeroing first): the fused ring
  // backward accumulates every step's dq in one buffer.
  bool accumulate_dq = false;
  void* dk = nullptr;           // [B, T, Hkv, D], fp32 or the input type
  void* dv = nullptr;
  bool dkv_in_input_type = false;
  int batch = 0, s_q = 0, s_kv = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBF16;
  float scale = 1.0f;
  bool causal = false;
  bool zigzag = false;
  int n = 1;                    // ring size (global positions)
  // The device's error word (DeviceHeader::error_claim), or null: while it
  // is set (a pk wait on this device failed and check_errors() has not run)
  // the outputs are poison (NaN), like every pk op's after a failure.
  const int32_t* claim = nullptr;
  cudaStream_t stream = nullptr;
};

// False when the extension was built without CUTLASS.
bool available();
// Head dim 64 or 128, Hq a multiple of Hkv, rows that fill whole tiles
// (each zigzag chunk too, so a tile's rows are consecutive tokens).
bool supported(const Params& p);
// What run() would refuse (supported(), the kernel's own checks), without
// enqueueing anything.
cudaError_t check(const Params& p);
// dq = 0 (NaN while the device holds an error; skipped with accumulate_dq),
// then one kernel launch on p.stream. The kernel is checked before anything is enqueued.
cudaError_t run(const Params& p);
cudaError_t load_kernels();

// The instantiations (kernels/common/variants.h): one per (element type,
// head dim), instantiations/bwd_<type>_d<D>.cu; defined in
// attention_bwd_sm90.cuh.
struct VariantKey {
  DType dtype;
  int head_dim;
};
constexpr bool operator==(const VariantKey& a, const VariantKey& b) {
  return a.dtype == b.dtype && a.head_dim == b.head_dim;
}
template <DType kType, int kHeadDim>
struct Variant {
  static constexpr VariantKey key{kType, kHeadDim};
  static cudaError_t check(const Params& p);  // what launch() would refuse
  static cudaError_t launch(const Params& p);
  static cudaError_t load();
};

}  // namespace pk::attention_bwd
