// Host side of the fused ring attention: the stream protocol of
// ring_attention.h and the dispatch to the kernel instantiations.
#include "kernels/ring_attention/ring_attention.h"

#include "kernels/gemm/gemm.h"
#include "pk/copy_rows.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

#include "kernels/common/variants.h"

namespace pk::ring_attention {
namespace {

using Instantiations = variants::Built<
    Variant<DType::kBF16, 128, Mechanism::kCopyEngine>,
    Variant<DType::kBF16, 64, Mechanism::kCopyEngine>,
    Variant<DType::kF16, 128, Mechanism::kCopyEngine>,
    Variant<DType::kF16, 64, Mechanism::kCopyEngine>,
    Variant<DType::kBF16, 128, Mechanism::kLdSt>, Variant<DType::kBF16, 64, Mechanism::kLdSt>,
    Variant<DType::kF16, 128, Mechanism::kLdSt>, Variant<DType::kF16, 64, Mechanism::kLdSt>,
    Variant<DType::kBF16, 128, Mechanism::kCopyEngine, Form::kPersistent>,
    Variant<DType::kF16, 128, Mechanism::kCopyEngine, Form::kPersistent>,
    Variant<DType::kBF16, 64, Mechanism::kCopyEngine, Form::kWide>,
    Variant<DType::kF16, 64, Mechanism::kCopyEngine, Form::kWide>,
    Variant<DType::kBF16, 64, Mechanism::kLdSt, Form::kWide>,
    Variant<DType::kF16, 64, Mechanism::kLdSt, Form::kWide>,
    Variant<DType::kBF16, 256, Mechanism::kCopyEngine>,
    Variant<DType::kF16, 256, Mechanism::kCopyEngine>,
    Variant<DType::kBF16, 256, Mechanism::kLdSt>, Variant<DType::kF16, 256, Mechanism::kLdSt>>;

// The tile form of p's call (tools/attention_sweep, benchmarks/NOTES.md,
// 2026-12-05): head dim 64 takes 192-key tiles (9% faster at 16k-row
// chunks) where the keys its walk loads exceed the chunk's by at most 2% (the
// last tile, placed at the chunk's end, repeats some): every chunk of 9,600
// rows or more, shorter ones near a multiple of 192. Head dim 128 on a ring
// of one (mechanism copy_engine) with at most kPersistentRows tokens runs
// persistent CTAs, the next tile's loads and this one's O store across the
// tile boundary (tools/attention_sweep, 2026-12-07: 1.04x at 16 x 1024
// tokens full, 1.07x causal at 1024 and 2048, level at 2048 full and 4096
// causal, 0.95x at 4096 full, 0.69x at 8192 causal).
Form form_of(const Params& p) {
  constexpr int kPersistentRows = 2048;
  if (p.head_dim == 128 && p.mechanism == Mechanism::kCopyEngine && p.geo.n == 1 &&
      p.geo.s_local <= kPersistentRows)
    return Form::kPersistent;
  if (p.head_dim == 64) {
    constexpr int kWideKeys = 192;
    const int64_t rows = p.geo.chunk_rows();
    const int64_t walked = (rows + kWideKeys - 1) / kWideKeys * kWideKeys;
    if (rows >= kWideKeys && walked * 50 <= rows * 51) return Form::kWide;
  }
  return Form::kBase;
}

// The attention kernel of p's (type, head dim, mechanism, form).
cudaError_t launch_kernel(const Params& p, const KernelArgs& a) {
  return Instantiations::launch(VariantKey{p.dtype, p.head_dim, p.mechanism, form_of(p)}, a);
}

// What launch_kernel would refuse, before anything is enqueued.
cudaError_t check_kernel(const Params& p, const KernelArgs& a) {
  return Instantiations::check(VariantKey{p.dtype, p.head_dim, p.mechanism, form_of(p)}, a);
}

// Where our block goes in the peers' regions (kv_walk.cuh).
PushLayout push_layout(const Params& p) {
  const Geometry& g = p.geo;
  return PushLayout{g.rank, g.n, p.batch, p.pieces,
                    block_bytes(1, g.s_local, p.kv_heads, p.head_dim)};  // one batch
}

// Where V's peer blocks start in a region (K's start at 0): both halves are
// n - 1 blocks.
size_t v_offset(const Params& p) { return push_layout(p).v_offset(); }

// Piece `i` of our block `src` (K or V) into our slot of peer(k)'s region
// half `dst` (K's or V's): the piece's rows of every batch, one 1-D copy per
// batch (pk/copy_rows.h says why not 2-D).
cudaError_t copy_piece(const Params& p, char* dst, const void* src, int k, int i,
                       cudaStream_t stream) {
  const PushLayout L = push_layout(p);
  const size_t token = L.row_bytes / size_t(p.geo.s_local);  // one row, every K/V head
  int r0, r1;
  p.plan().rows(i, r0, r1);
  const size_t off = size_t(r0) * token;
  return copy_rows(dst + L.slot(k, 0) + off, L.pitch(), static_cast<const char*>(src) + off,
                   L.row_bytes, size_t(r1 - r0) * token, p.batch, stream);
}

// Push our K and V blocks to every peer on the side stream, posting each
// piece with a stream copy of its stamp (see ring_attention.h).
cudaError_t push_blocks(const Params& p) {
  const Geometry& g = p.geo;
  const PushLayout L = push_layout(p);
  for (int k = 1; k < g.n; ++k) {
    const int q = L.peer(k);
    char* k_half = p.region[q];
    char* v_half = k_half + L.v_offset();
    for (int i = 0; i < p.pieces; ++i) {
      PK_CUDA_TRY(copy_piece(p, k_half, p.k, k, i, p.side_stream));
      PK_CUDA_TRY(copy_piece(p, v_half, p.v, k, i, p.copy_stream));
      // Reusing one event is safe: each wait binds to the record before it.
      PK_CUDA_TRY(cudaEventRecord(p.copy_done, p.copy_stream));
      PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.copy_done, 0));
      if (!p.skip_post)
        PK_CUDA_TRY(cudaMemcpyAsync(&p.ch.flags[q]->posted[g.rank], &p.ch.mine()->stamp[i],
                                    sizeof(uint64_t), cudaMemcpyDeviceToDevice, p.side_stream));
    }
  }
  return cudaSuccess;
}

// The kernel's arguments; mechanism ld_st with peers: its communicator CTAs
// (comm_push.cuh).
KernelArgs kernel_args(const Params& p) {
  const Geometry& g = p.geo;
  KernelArgs a{&p, p.region[g.rank], p.region[g.rank] + v_offset(p), PushArgs{}};
  if (p.mechanism == Mechanism::kLdSt && g.n > 1) {
    PushArgs& push = a.push;
    push.k = static_cast<const char*>(p.k);
    push.v = static_cast<const char*>(p.v);
    for (int r = 0; r < g.n; ++r) push.region[r] = p.region[r];
    push.layout = push_layout(p);
    push.ch = p.ch;
    push.ctas = p.num_comm_ctas;
    push.skip_post = p.skip_post;
  }  // one rank, or copy_engine: no communicator CTAs (a.push.ctas == 0)
  return a;
}

// Everything up to the join (n > 1; *forked once the side streams wait on
// ours). Mechanism ld_st: credit, then one kernel whose communicator CTAs
// push and post; no side stream. copy_engine: see ring_attention.h.
cudaError_t enqueue(const Params& p, const KernelArgs& a, bool* forked) {
  PK_CUDA_TRY(signals::wait_credit(p.ch, p.stream));
  if (p.mechanism == Mechanism::kCopyEngine) {
    PK_CUDA_TRY(signals::stamp(p.ch, p.pieces, p.stream));
    PK_CUDA_TRY(cudaEventRecord(p.fork, p.stream));
    PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.fork, 0));
    *forked = true;
    PK_CUDA_TRY(cudaStreamWaitEvent(p.copy_stream, p.fork, 0));
    PK_CUDA_TRY(push_blocks(p));
  }
  return launch_kernel(p, a);
}

}  // namespace

// The kernel needs the CUTLASS headers, like the GEMM: one build switch.
bool available() { return gemm::available(); }

// A chunk of whole 128-row query tiles; the kernel checks that it holds a
// key tile (RingMainloop::can_implement: 128 keys, 80 at head dim 256, or
// 192 in head dim 64's wide form, which form_of picks only for chunks of 192
// rows or more).
bool supported(const Params& p) {
  const Geometry& g = p.geo;
  return available() && (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256) &&
         p.kv_heads > 0 &&
         p.q_heads % p.kv_heads == 0 && g.s_local > 0 && g.chunk_rows() % kTileQ == 0 &&
         p.pieces <= kMaxPieces && p.plan().valid() &&
         (p.mechanism == Mechanism::kCopyEngine ||
          (p.mechanism == Mechanism::kLdSt && p.num_comm_ctas >= 1 &&
           p.num_comm_ctas <= kMaxCommCtas &&
           // the communicator CTAs' 16-byte vectors (TMA needs as much)
           (reinterpret_cast<uintptr_t>(p.k) | reinterpret_cast<uintptr_t>(p.v)) % 16 == 0));
}

cudaError_t run(const Params& p) {
  if (!supported(p)) return cudaErrorNotSupported;
  const Geometry& g = p.geo;
  const KernelArgs a = kernel_args(p);
  PK_CUDA_TRY(check_kernel(p, a));  // refuse before the first enqueue
  if (g.n == 1) return launch_kernel(p, a);  // no protocol; the kernel poisons itself
  const size_t rows = size_t(p.batch) * size_t(g.s_local) * size_t(p.q_heads);
  signals::Outputs out(p.out, rows * size_t(p.head_dim) * 2);
  out.add(p.lse, rows * sizeof(float));
  bool forked = false;
  cudaError_t err = enqueue(p, a, &forked);
  if (forked) {
    // The side stream waited for the copy stream's last piece: joining it
    // joins both (after an error in push_blocks, it waits for the copy
    // stream first).
    if (err != cudaSuccess) err = signals::join(err, p.copy_done, p.copy_stream, p.side_stream);
    err = signals::join(err, p.join, p.side_stream, p.stream);
  }
  return signals::finish_after(err, p.ch, out, p.stream);
}

cudaError_t load_kernels() { return Instantiations::load(); }

}  // namespace pk::ring_attention
