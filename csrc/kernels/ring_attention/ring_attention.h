// Ring attention forward, fused: one attention kernel covers every ring step.
//
// For call epoch e on rank r of n:
//   main:  wait credit (every peer finished reading what we staged with it
//          last call), stamp the post values, fork the side stream;
//   side:  for each peer q, nearest first, the copy engines push our K and V
//          block into slot (q - r - 1) of q's region, piece by piece (K on
//          the side stream, V on the copy stream: two engines at once), each
//          piece followed by a stream copy of its stamp into q's posted[r]
//          once both halves landed (no SM is involved, so a kernel spinning
//          on the flag cannot starve the post);
//   main:  the attention kernel: each query tile walks our own block, then
//          each peer's block as its pieces are posted (kv_walk.cuh), merging
//          all steps in registers; O and the log-sum-exp are written once;
//          join the side stream; finish (done[r] = e to every peer; the
//          outputs poisoned if the call failed).
// Mechanism ld_st: no copy engines and no side streams. Main: wait credit,
// then the attention kernel with `num_comm_ctas` extra CTAs in front of the
// compute CTAs (comm_push.cuh): they push our K and V block into the same
// slots with 16-byte loads/stores over NVLink, piece by piece, nearest peer
// first, and the last CTA to finish a piece posts its stamp value into
// q's posted[r]; the compute CTAs and their per-piece waits are the same;
// then finish.
// The kernel is checked before anything is enqueued; a CUDA error from an
// enqueue still joins the side streams and finishes the call, as aborted.
// A CTA of the kernel that ends while the device holds an error writes NaN
// (also with one rank, where no finish runs).
// The region holds n - 1 peer blocks, K then V: [B, (n - 1) * s_local, Hkv, D]
// each (PushLayout, kv_walk.cuh), posted in pieces of whole rows (PiecePlan).
// (A ring would forward blocks hop by hop through a double buffer; on NVLink
// switches every pair has full bandwidth, so direct pushes move the same
// bytes per link without the forwarding chain, for (n - 1) blocks of memory
// instead of 2.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/common/dtype.h"
#include "kernels/ring_attention/kv_walk.cuh"
#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::ring_attention {

using pk::DType;  // bf16 or fp16
// How our K/V block reaches the peers (the FFI attribute `mechanism`).
enum class Mechanism : int32_t { kCopyEngine = 0, kLdSt = 1 };

// Query rows per CTA tile; a tile never straddles a zigzag chunk.
inline constexpr int kTileQ = 128;
// Most pieces a peer's block is posted in: one stamp each.
inline constexpr int kMaxPieces = kMaxStamps;
// Communicator CTAs of mechanism ld_st: the default and the most allowed.
inline constexpr int kDefaultCommCtas = 16;
inline constexpr int kMaxCommCtas = 32;

struct Params {
  const void* q = nullptr;  // [B, s_local, Hq, D]
  const void* k = nullptr;  // [B, s_local, Hkv, D]
  const void* v = nullptr;
  void* out = nullptr;      // [B, s_local, Hq, D]
  float* lse = nullptr;     // [B, Hq, s_local], natural log, scale included
  int batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::kBF16;
  float scale = 1.0f;
  Geometry geo{};
  int pieces = 1;           // pieces each peer's block is posted in (fixed per channel)
  bool skip_post = false;   // testing: push the data but never post it
  Mechanism mechanism = Mechanism::kCopyEngine;
  int num_comm_ctas = kDefaultCommCtas;  // ld_st only: 1..kMaxCommCtas
  Channel ch{};
  char* region[kMaxRanks] = {};
  int sm_count = 0;
  cudaStream_t stream = nullptr;
  cudaStream_t side_stream = nullptr;
  cudaEvent_t fork = nullptr;
  cudaEvent_t join = nullptr;
  cudaStream_t copy_stream = nullptr;  // V's copies, beside K's on side_stream
  cudaEvent_t copy_done = nullptr;

  PiecePlan plan() const { return {pieces, geo.s_local}; }
};

// Bytes of one rank's K (or V) block.
inline size_t block_bytes(int batch, int s_local, int kv_heads, int head_dim) {
  return size_t(batch) * s_local * kv_heads * head_dim * 2;
}
// False when the extension was built without CUTLASS.
bool available();
// head_dim 64, 128 or 256; tiles fit the layout (see the Python checks).
bool supported(const Params& p);
cudaError_t run(const Params& p);
cudaError_t load_kernels();

// What the communicator CTAs of mechanism ld_st need (comm_push.cuh).
struct PushArgs {
  const char* k = nullptr;  // our blocks [B, s_local, Hkv, D]
  const char* v = nullptr;
  char* region[kMaxRanks] = {};  // every rank's channel region (peer mapped)
  PushLayout layout{};
  Channel ch{};
  int ctas = 0;             // the kernel's first `ctas` CTAs push; 0: none (one rank)
  bool skip_post = false;
};

// The attention kernel alone (the instantiations,
// instantiations/attention_<type>_d<D>*.cu).
struct KernelArgs {
  const Params* p;
  const void* k_peers;
  const void* v_peers;
  PushArgs push;  // ld_st only
};
// The forward's tile form beyond (type, head dim, mechanism): the fastest
// configuration of tools/attention_sweep per shape class (benchmarks/NOTES.md,
// 2026-12-05), picked per call by ring_attention.cu's form_of.
enum class Form : int32_t {
  kBase = 0,  // 128 keys a tile (FwdTile's defaults); head dim 256: 80
  kWide = 1,  // head dim 64, long chunks: 192 keys a tile, O rescaled under QK
  kPersistent = 2,  // head dim 128, a ring of one, short sequences: persistent CTAs
};
// The instantiations (kernels/common/variants.h): one per (element type,
// head dim, mechanism, form),
// instantiations/attention_<type>_d<D>[_k192|_persistent][_ld_st].cu; defined in
// attention_sm90.cuh.
struct VariantKey {
  DType dtype;
  int head_dim;
  Mechanism mechanism;
  Form form;
};
constexpr bool operator==(const VariantKey& a, const VariantKey& b) {
  return a.dtype == b.dtype && a.head_dim == b.head_dim && a.mechanism == b.mechanism &&
         a.form == b.form;
}
template <DType kType, int kHeadDim, Mechanism kMechanism, Form kForm = Form::kBase>
struct Variant {
  static constexpr VariantKey key{kType, kHeadDim, kMechanism, kForm};
  static cudaError_t check(const KernelArgs& a);  // what launch() would refuse
  static cudaError_t launch(const KernelArgs& a);
  static cudaError_t load();
};

}  // namespace pk::ring_attention
