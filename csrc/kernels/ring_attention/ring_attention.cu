// Host side of the fused ring attention: the stream protocol of
// ring_attention.h and the dispatch to the kernel instantiations.
#include "kernels/ring_attention/ring_attention.h"

#include "kernels/gemm/gemm.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

#include "kernels/common/attention_variants.cuh"

namespace pk::ring_attention {
namespace {

// Where V's peer blocks start in a region (K's start at 0): both halves are
// n - 1 blocks.
size_t v_offset(const Params& p) {
  return size_t(p.geo.n - 1) * block_bytes(p.batch, p.geo.s_local, p.kv_heads, p.head_dim);
}

// Push our K and V blocks to every peer on the side stream, posting each
// piece with a stream copy of its stamp (see ring_attention.h).
cudaError_t push_blocks(const Params& p) {
  const Geometry& g = p.geo;
  const size_t row_bytes = block_bytes(1, g.s_local, p.kv_heads, p.head_dim);  // one batch
  const size_t piece_bytes = row_bytes / p.pieces;
  for (int k = 1; k < g.n; ++k) {
    const int q = (g.rank + k) % g.n;
    // Our block is slot k - 1 of q's region; batch b's rows sit n - 1 blocks apart.
    char* k_dst = p.region[q] + size_t(k - 1) * row_bytes;
    char* v_dst = k_dst + v_offset(p);
    const size_t pitch = size_t(g.n - 1) * row_bytes;
    for (int i = 0; i < p.pieces; ++i) {
      const size_t off = size_t(i) * piece_bytes;
      PK_CUDA_TRY(cudaMemcpy2DAsync(k_dst + off, pitch, static_cast<const char*>(p.k) + off,
                                    row_bytes, piece_bytes, p.batch, cudaMemcpyDeviceToDevice,
                                    p.side_stream));
      PK_CUDA_TRY(cudaMemcpy2DAsync(v_dst + off, pitch, static_cast<const char*>(p.v) + off,
                                    row_bytes, piece_bytes, p.batch, cudaMemcpyDeviceToDevice,
                                    p.copy_stream));
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

}  // namespace

// The kernel needs the CUTLASS headers, like the GEMM: one build switch.
bool available() { return gemm::available(); }

bool supported(const Params& p) {
  const Geometry& g = p.geo;
  const int tile_k = p.head_dim == 64 ? 64 : 128;
  return available() && (p.head_dim == 64 || p.head_dim == 128) && p.kv_heads > 0 &&
         p.q_heads % p.kv_heads == 0 && g.s_local > 0 && g.chunk_rows() % kTileQ == 0 &&
         g.chunk_rows() % tile_k == 0 && p.pieces >= 1 && p.pieces <= kMaxPieces &&
         g.s_local % p.pieces == 0;
}

cudaError_t run(const Params& p) {
#ifdef PK_HAVE_CUTLASS
  if (!supported(p)) return cudaErrorNotSupported;
  const Geometry& g = p.geo;
  KernelArgs a{&p, p.region[g.rank], p.region[g.rank] + v_offset(p)};
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
  return attention_variants::load_all<AttentionVariants>();
#else
  return cudaSuccess;
#endif
}

}  // namespace pk::ring_attention
