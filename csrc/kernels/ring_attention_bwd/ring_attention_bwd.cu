// Host side of the fused ring attention backward: the stream protocol of
// ring_attention_bwd.h around the block-backward kernel (kernels/attention_bwd).
#include "kernels/ring_attention_bwd/ring_attention_bwd.h"

#include "kernels/attention_bwd/attention_bwd.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::ring_attention_bwd {
namespace {

int ring(int x, int n) { return ((x % n) + n) % n; }

uint64_t* stamps(const Params& p) {
  return reinterpret_cast<uint64_t*>(p.scratch + p.layout().scratch_stamps());
}
int post_count(const Params& p) { return p.ch.n + 1; }  // post 0: K/V; s: partials; n: home

// The block kernel's arguments at step s: our queries against B_s (the block
// of rank r - s), its dK/dV into `dkv` (fp32), dq zeroed at step 0.
attention_bwd::Params block(const Params& p, int s, float* dkv) {
  const Layout L = p.layout();
  const int r = p.ch.rank, n = p.ch.n;
  attention_bwd::Params b;
  b.q = p.q;
  b.dout = p.dout;
  b.lse = p.lse;
  b.delta = p.delta;
  b.k = s == 0 ? p.kv : static_cast<const void*>(p.region[r] + L.kv_slot(s));
  b.v = static_cast<const char*>(b.k) + L.kv_bytes / 2;
  b.q_rank = p.ranks + r;
  b.k_rank = p.ranks + ring(r - s, n);
  b.dq = p.dq;
  b.accumulate_dq = s > 0;
  b.dk = dkv;
  b.dv = dkv + L.partial_bytes / 2 / sizeof(float);
  b.batch = p.batch;
  b.s_q = p.s_q;
  b.s_kv = p.s_kv;
  b.q_heads = p.q_heads;
  b.kv_heads = p.kv_heads;
  b.head_dim = p.head_dim;
  b.dtype = p.dtype;
  b.scale = p.scale;
  b.causal = p.causal;
  b.zigzag = p.zigzag;
  b.n = n;
  b.claim = p.ch.wait.claim;
  b.stream = p.stream;
  return b;
}

// A stream copy of post `i` into `peer`'s posted[r] (pk/signals.h: stamp_table).
cudaError_t post(const Params& p, int peer, int i, cudaStream_t stream) {
  if (p.skip_post) return cudaSuccess;
  return cudaMemcpyAsync(&p.ch.flags[peer]->posted[p.ch.rank], stamps(p) + i, sizeof(uint64_t),
                         cudaMemcpyDeviceToDevice, stream);
}

// Copy stream: our K/V into slot k of rank r + k's region, nearest first,
// each posted (post 0); the side stream's posts to r + 1 wait for the first.
cudaError_t push_kv(const Params& p) {
  const Layout L = p.layout();
  const int r = p.ch.rank, n = p.ch.n;
  for (int k = 1; k < n; ++k) {
    const int q = ring(r + k, n);
    PK_CUDA_TRY(cudaMemcpyAsync(p.region[q] + L.kv_slot(k), p.kv, L.kv_bytes,
                                cudaMemcpyDeviceToDevice, p.copy_stream));
    PK_CUDA_TRY(post(p, q, 0, p.copy_stream));
    if (k == 1) {
      PK_CUDA_TRY(cudaEventRecord(p.copy_done, p.copy_stream));
      PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.copy_done, 0));
    }
  }
  return cudaSuccess;
}

// Side stream, once main reaches this point: `bytes` at `src` into `dst_offset`
// of rank r + 1's region, then post `i` there.
cudaError_t push_next(const Params& p, const void* src, size_t dst_offset, size_t bytes, int i) {
  const int next = ring(p.ch.rank + 1, p.ch.n);
  // Reusing one event is safe: each wait binds to the record before it.
  PK_CUDA_TRY(cudaEventRecord(p.fork, p.stream));
  PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.fork, 0));
  PK_CUDA_TRY(cudaMemcpyAsync(p.region[next] + dst_offset, src, bytes, cudaMemcpyDeviceToDevice,
                              p.side_stream));
  return post(p, next, i, p.side_stream);
}

// Everything up to the join (*forked once the side and copy streams wait on ours).
cudaError_t enqueue(const Params& p, bool* forked) {
  const Layout L = p.layout();
  const int r = p.ch.rank, n = p.ch.n, count = post_count(p);
  const int prev = ring(r - 1, n);
  char* mine = p.region[r];
  float* grads = reinterpret_cast<float*>(p.scratch + L.scratch_grads());
  float* first = reinterpret_cast<float*>(p.scratch + L.scratch_first());
  void* home_value = p.scratch + L.scratch_home();
  const size_t elems = L.partial_bytes / sizeof(float);
  const int32_t* claim = p.ch.wait.claim;

  PK_CUDA_TRY(signals::wait_credit(p.ch, p.stream));
  PK_CUDA_TRY(signals::stamp_table(p.ch, stamps(p), count, p.stream));
  PK_CUDA_TRY(cudaEventRecord(p.fork, p.stream));
  PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.fork, 0));
  PK_CUDA_TRY(cudaStreamWaitEvent(p.copy_stream, p.fork, 0));
  *forked = true;
  PK_CUDA_TRY(push_kv(p));

  // Step 0: our own block; its contribution is the whole partial so far.
  PK_CUDA_TRY(attention_bwd::run(block(p, 0, first)));
  PK_CUDA_TRY(push_next(p, first, L.partial_slot(1), L.partial_bytes, 1));
  for (int s = 1; s < n; ++s) {
    PK_CUDA_TRY(signals::wait_stamp(p.ch, ring(r - s, n), 0, count, p.stream));  // B_s landed
    PK_CUDA_TRY(attention_bwd::run(block(p, s, grads)));
    PK_CUDA_TRY(signals::wait_stamp(p.ch, prev, s, count, p.stream));  // B_s's partial landed
    float* partial = reinterpret_cast<float*>(mine + L.partial_slot(s));
    if (s < n - 1) {
      PK_CUDA_TRY(add_partial(partial, grads, elems, claim, p.stream));
      PK_CUDA_TRY(push_next(p, partial, L.partial_slot(s + 1), L.partial_bytes, s + 1));
    } else {  // finished: B_{n-1} belongs to rank r + 1
      PK_CUDA_TRY(add_cast(home_value, p.dtype, partial, grads, elems, claim, p.stream));
      PK_CUDA_TRY(push_next(p, home_value, L.home(), L.kv_bytes, n));
    }
  }
  PK_CUDA_TRY(signals::wait_stamp(p.ch, prev, n, count, p.stream));  // ours came home
  return cudaMemcpyAsync(p.dkv, mine + L.home(), L.kv_bytes, cudaMemcpyDeviceToDevice,
                         p.stream);
}

}  // namespace

bool available() { return attention_bwd::available(); }

bool supported(const Params& p) {
  return p.ch.n >= 2 && p.ch.n <= kMaxRanks && p.ranks != nullptr && p.scratch != nullptr &&
         attention_bwd::supported(block(p, 0, nullptr));
}

cudaError_t run(const Params& p) {
  if (!supported(p)) return cudaErrorNotSupported;
  // Refuse before the first enqueue: every step's kernel has these shapes
  // (only the K/V pointers and ranks differ), so step 0's check covers them.
  PK_CUDA_TRY(attention_bwd::check(
      block(p, 0, reinterpret_cast<float*>(p.scratch + p.layout().scratch_first()))));
  const Layout L = p.layout();
  signals::Outputs out(p.dq, size_t(p.batch) * size_t(p.s_q) * size_t(p.q_heads) *
                                 size_t(p.head_dim) * sizeof(float));
  out.add(p.dkv, L.kv_bytes);
  bool forked = false;
  const cudaError_t err = enqueue(p, &forked);
  if (forked) {
    // Join even after an error, so no stream dangles: main waits for the
    // copy stream's last push and the side stream's last post.
    cudaError_t e = cudaEventRecord(p.copy_done, p.copy_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(p.stream, p.copy_done, 0);
    if (e == cudaSuccess) e = cudaEventRecord(p.join, p.side_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(p.stream, p.join, 0);
    if (err == cudaSuccess && e != cudaSuccess) {
      signals::finish(p.ch, out, p.stream, /*aborted=*/true);  // best effort
      return e;
    }
  }
  if (err != cudaSuccess) {
    signals::finish(p.ch, out, p.stream, /*aborted=*/true);  // best effort
    return err;
  }
  return signals::finish(p.ch, out, p.stream);
}

}  // namespace pk::ring_attention_bwd
