// Host side of the fused ring attention: the stream protocol of
// ring_attention.h and the dispatch to the kernel instantiations.
#include "kernels/ring_attention/ring_attention.h"

#include "kernels/gemm/gemm.h"
#include "pk/copy_rows.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

#include "kernels/common/attention_variants.cuh"

namespace pk::ring_attention {
namespace {

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
// half `dst` (K's or V's), in the layout the plan says (ring_attention.h).
// Every copy is a run of 1-D copies (pk/copy_rows.h says why not 2-D) with
// rows of at least a head's piece rows: narrow, strided gathers are not pure
// copy-engine work (they took SMs that a spinning attention kernel never
// frees; benchmarks/NOTES.md, run 5).
cudaError_t copy_piece(const Params& p, char* dst, const void* src, int k, int i,
                       cudaStream_t stream) {
  const Geometry& g = p.geo;
  const PiecePlan plan = p.plan();
  const char* from = static_cast<const char*>(src);
  if (!plan.by_heads) {
    // Row-major [B, S, Hkv, D] slots (PushLayout): a copy per batch.
    const PushLayout L = push_layout(p);
    const size_t off = size_t(i) * L.piece_bytes();
    return copy_rows(dst + L.slot(k, 0) + off, L.pitch(), from + off, L.row_bytes,
                     L.piece_bytes(), p.batch, stream);
  }
  // Head-major source [B, Hkv, S, D] into the head-major region
  // [B, Hkv, (n - 1) * S, D]: per batch, one copy per head for each run of
  // heads whose rows in this piece are the same (whole heads, or one head's
  // row range).
  const size_t line = size_t(p.head_dim) * 2;  // one head of one row
  const size_t src_head = size_t(g.s_local) * line, dst_head = size_t(g.n - 1) * src_head;
  for (int b = 0; b < p.batch; ++b) {
    for (int h = plan.first_head(i); h <= plan.last_head(i);) {
      int r0, r1;
      plan.rows(i, h, r0, r1);
      int h_end = h + 1;  // heads [h, h_end) share rows [r0, r1)
      for (int e0, e1; h_end <= plan.last_head(i); ++h_end) {
        plan.rows(i, h_end, e0, e1);
        if (e0 != r0 || e1 != r1) break;
      }
      const size_t bh = size_t(b) * p.kv_heads + h;
      const size_t row = size_t(k - 1) * g.s_local + r0;  // our slot is k - 1
      PK_CUDA_TRY(copy_rows(dst + bh * dst_head + row * line, dst_head,
                            from + bh * src_head + size_t(r0) * line, src_head,
                            size_t(r1 - r0) * line, h_end - h, stream));
      h = h_end;
    }
  }
  return cudaSuccess;
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

// Mechanism ld_st: credit, then one kernel whose communicator CTAs push and
// post (comm_push.cuh), then finish. No side stream.
cudaError_t run_ld_st(const Params& p, KernelArgs a) {
  const Geometry& g = p.geo;
  if (g.n > 1) {
    PK_CUDA_TRY(signals::wait_credit(p.ch, p.stream));
    PushArgs& push = a.push;
    push.k = static_cast<const char*>(p.k);
    push.v = static_cast<const char*>(p.v);
    for (int r = 0; r < g.n; ++r) push.region[r] = p.region[r];
    push.layout = push_layout(p);
    push.ch = p.ch;
    push.ctas = p.num_comm_ctas;
    push.skip_post = p.skip_post;
  }  // one rank: no communicator CTAs (a.push.ctas == 0)
  PK_CUDA_TRY(attention_variants::launch<LdStAttentionVariants>(p.dtype == DType::kBF16,
                                                                p.head_dim, a));
  return g.n > 1 ? signals::finish(p.ch, p.stream) : cudaSuccess;
}

}  // namespace

// The kernel needs the CUTLASS headers, like the GEMM: one build switch.
bool available() { return gemm::available(); }

bool supported(const Params& p) {
  const Geometry& g = p.geo;
  const int tile_k = p.head_dim == 64 ? 64 : 128;
  return available() && (p.head_dim == 64 || p.head_dim == 128) && p.kv_heads > 0 &&
         p.q_heads % p.kv_heads == 0 && g.s_local > 0 && g.chunk_rows() % kTileQ == 0 &&
         g.chunk_rows() % tile_k == 0 && p.pieces <= kMaxPieces && p.plan().valid() &&
         (p.mechanism == Mechanism::kCopyEngine ||
          (p.mechanism == Mechanism::kLdSt && !p.by_heads && p.num_comm_ctas >= 1 &&
           p.num_comm_ctas <= kMaxCommCtas &&
           // the communicator CTAs' 16-byte vectors (TMA needs as much)
           (reinterpret_cast<uintptr_t>(p.k) | reinterpret_cast<uintptr_t>(p.v)) % 16 == 0));
}

cudaError_t run(const Params& p) {
#ifdef PK_HAVE_CUTLASS
  if (!supported(p)) return cudaErrorNotSupported;
  const Geometry& g = p.geo;
  KernelArgs a{&p, p.region[g.rank], p.region[g.rank] + v_offset(p), PushArgs{}};
  if (p.mechanism == Mechanism::kLdSt) return run_ld_st(p, a);
  if (g.n > 1) {
    PK_CUDA_TRY(signals::wait_credit(p.ch, p.stream));
    PK_CUDA_TRY(signals::stamp(p.ch, p.pieces, p.stream));
    PK_CUDA_TRY(cudaEventRecord(p.fork, p.stream));
    PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.fork, 0));
    PK_CUDA_TRY(cudaStreamWaitEvent(p.copy_stream, p.fork, 0));
    PK_CUDA_TRY(push_blocks(p));
  }
  PK_CUDA_TRY(attention_variants::launch<AttentionVariants>(p.dtype == DType::kBF16, p.head_dim, a));
  if (g.n == 1) return cudaSuccess;
  // The side stream waited for the copy stream's last piece: joining it joins both.
  PK_CUDA_TRY(cudaEventRecord(p.join, p.side_stream));
  PK_CUDA_TRY(cudaStreamWaitEvent(p.stream, p.join, 0));
  return signals::finish(p.ch, p.stream);
#else
  (void)p;
  return cudaErrorNotSupported;
#endif
}

cudaError_t load_kernels() {
#ifdef PK_HAVE_CUTLASS
  PK_CUDA_TRY(attention_variants::load_all<AttentionVariants>());
  return attention_variants::load_all<LdStAttentionVariants>();
#else
  return cudaSuccess;
#endif
}

}  // namespace pk::ring_attention
