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

// The block kernel's arguments at step s: our queries against B_s (the block
// of rank r - s: our own k and v at step 0, else slot s % 2 of our region),
// its dK/dV into `dkv` (fp32, dK then dV), dq zeroed at step 0.
attention_bwd::Params block(const Params& p, int s, float* dkv) {
  const Layout L = p.layout();
  const int r = p.ch.rank, n = p.ch.n;
  attention_bwd::Params b = p.block;
  if (s > 0) {
    b.k = p.region[r] + L.kv_slot(s);
    b.v = static_cast<const char*>(b.k) + L.k_bytes();
  }
  b.q_rank = p.ranks + r;
  b.k_rank = p.ranks + ring(r - s, n);
  b.dq = p.dq;
  b.accumulate_dq = s > 0;
  b.dk = dkv;
  b.dv = dkv == nullptr ? nullptr : dkv + L.partial_bytes / 2 / sizeof(float);
  b.dkv_in_input_type = false;
  b.claim = p.ch.wait.claim;
  b.stream = p.stream;
  return b;
}

// A stream copy of post `i` into `peer`'s posted[r] (pk/signals.h:
// stamp_table), on the side stream: every post of this rank goes there, in
// increasing i (Posts).
cudaError_t post(const Params& p, int peer, int i) {
  if (p.skip_post) return cudaSuccess;
  return cudaMemcpyAsync(&p.ch.flags[peer]->posted[p.ch.rank], stamps(p) + i, sizeof(uint64_t),
                         cudaMemcpyDeviceToDevice, p.side_stream);
}

// `bytes` at `src` into `dst_offset` of next's region on the side stream, then post `i` there.
cudaError_t push(const Params& p, const void* src, size_t dst_offset, size_t bytes, int i) {
  const int next = ring(p.ch.rank + 1, p.ch.n);
  PK_CUDA_TRY(cudaMemcpyAsync(p.region[next] + dst_offset, src, bytes, cudaMemcpyDeviceToDevice,
                              p.side_stream));
  return post(p, next, i);
}

// The side stream's share of step s, once main finished that step's add
// (ring_attention_bwd.h: side). `acc` / `home_value`: what the step made.
cudaError_t side_step(const Params& p, const Posts& P, int s, const float* acc,
                      const void* home_value) {
  const Layout L = p.layout();
  const int r = p.ch.rank, n = p.ch.n;
  const int prev = ring(r - 1, n), next = ring(r + 1, n);
  // Reusing one event is safe: each wait binds to the record before it.
  PK_CUDA_TRY(cudaEventRecord(p.fork, p.stream));
  PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.fork, 0));
  if (s >= 1) {
    PK_CUDA_TRY(post(p, prev, P.credit[s]));  // before our wait: no cycle around the ring
    PK_CUDA_TRY(signals::wait_stamp(p.ch, next, P.credit[s], P.count, p.side_stream,
                                    /*mark_clobbered=*/true));
  }
  if (s < n - 1) {
    PK_CUDA_TRY(push(p, acc, L.partial(), L.partial_bytes, P.partial[s + 1]));
    PK_CUDA_TRY(cudaEventRecord(p.join, p.side_stream));  // main's next add overwrites acc
  } else {  // finished: B_{n-1} belongs to next
    PK_CUDA_TRY(push(p, home_value, L.partial(), L.kv_bytes, P.home));
  }
  if (s + 2 <= n - 1) {  // forward B_{s+1}: next's B_{s+2}, into its slot of B_s
    char* block = p.region[r] + L.kv_slot(s + 1);
    PK_CUDA_TRY(signals::wait_stamp(p.ch, prev, P.kv[s + 1], P.count, p.side_stream));
    PK_CUDA_TRY(poison_if_failed(block, L.kv_bytes, p.ch.wait.claim, p.side_stream));
    PK_CUDA_TRY(push(p, block, L.kv_slot(s + 2), L.kv_bytes, P.kv[s + 2]));
  }
  return cudaSuccess;
}

// Our k and v into next's slot 1 (K then V, as a slot holds them), then post
// kv(1) there.
cudaError_t push_own_block(const Params& p, const Posts& P) {
  const Layout L = p.layout();
  const int next = ring(p.ch.rank + 1, p.ch.n);
  PK_CUDA_TRY(cudaMemcpyAsync(p.region[next] + L.kv_slot(1), p.block.k, L.k_bytes(),
                              cudaMemcpyDeviceToDevice, p.side_stream));
  return push(p, p.block.v, L.kv_slot(1) + L.k_bytes(), L.k_bytes(), P.kv[1]);
}

// Everything up to the join (*forked once the side stream waits on ours).
cudaError_t enqueue(const Params& p, bool* forked) {
  const Layout L = p.layout();
  const Posts P = make_posts(p.ch.n);
  const int r = p.ch.rank, n = p.ch.n;
  const int prev = ring(r - 1, n);
  char* mine = p.region[r];
  const float* partial = reinterpret_cast<const float*>(mine + L.partial());
  float* grads = reinterpret_cast<float*>(p.scratch + L.scratch_grads());
  float* acc = reinterpret_cast<float*>(p.scratch + L.scratch_acc());
  void* home_value = p.scratch + L.scratch_home();
  const size_t elems = L.partial_bytes / sizeof(float);
  const int32_t* claim = p.ch.wait.claim;

  PK_CUDA_TRY(signals::wait_credit(p.ch, p.stream));
  PK_CUDA_TRY(signals::stamp_table(p.ch, stamps(p), P.count, p.stream));
  PK_CUDA_TRY(cudaEventRecord(p.fork, p.stream));
  PK_CUDA_TRY(cudaStreamWaitEvent(p.side_stream, p.fork, 0));
  *forked = true;
  PK_CUDA_TRY(push_own_block(p, P));  // next's B_1

  // Step 0: our own block; its contribution is the whole partial so far.
  PK_CUDA_TRY(attention_bwd::run(block(p, 0, acc)));
  PK_CUDA_TRY(side_step(p, P, 0, acc, home_value));
  for (int s = 1; s < n; ++s) {
    PK_CUDA_TRY(signals::wait_stamp(p.ch, prev, P.kv[s], P.count, p.stream));  // B_s landed
    PK_CUDA_TRY(attention_bwd::run(block(p, s, grads)));
    PK_CUDA_TRY(signals::wait_stamp(p.ch, prev, P.partial[s], P.count, p.stream));
    PK_CUDA_TRY(cudaStreamWaitEvent(p.stream, p.join, 0));  // acc went on to next
    if (s < n - 1)
      PK_CUDA_TRY(add_partial(acc, partial, grads, elems, claim, p.stream));
    else
      PK_CUDA_TRY(add_cast(home_value, p.block.dtype, partial, grads, elems, claim, p.stream));
    PK_CUDA_TRY(side_step(p, P, s, acc, home_value));
  }
  PK_CUDA_TRY(signals::wait_stamp(p.ch, prev, P.home, P.count, p.stream));  // ours came home
  PK_CUDA_TRY(cudaMemcpyAsync(p.dk, mine + L.partial(), L.k_bytes(), cudaMemcpyDeviceToDevice,
                              p.stream));
  return cudaMemcpyAsync(p.dv, mine + L.partial() + L.k_bytes(), L.k_bytes(),
                         cudaMemcpyDeviceToDevice, p.stream);
}

}  // namespace

bool available() { return attention_bwd::available(); }

bool supported(const Params& p) {
  return p.ch.n >= 2 && p.ch.n <= kMaxRanks && p.block.n == p.ch.n && p.ranks != nullptr &&
         p.scratch != nullptr && attention_bwd::supported(block(p, 0, nullptr));
}

cudaError_t run(const Params& p) {
  if (!supported(p)) return cudaErrorNotSupported;
  // Refuse before the first enqueue: every step's kernel has these shapes
  // (only the K/V pointers and ranks differ), so step 0's check covers them.
  PK_CUDA_TRY(attention_bwd::check(
      block(p, 0, reinterpret_cast<float*>(p.scratch + p.layout().scratch_acc()))));
  const Layout L = p.layout();
  const attention_bwd::Params& b = p.block;
  signals::Outputs out(p.dq, size_t(b.batch) * size_t(b.s_q) * size_t(b.q_heads) *
                                 size_t(b.head_dim) * sizeof(float));
  out.add(p.dk, L.k_bytes());
  out.add(p.dv, L.k_bytes());
  bool forked = false;
  cudaError_t err = enqueue(p, &forked);
  // Main waits for the side stream's last push and post.
  if (forked) err = signals::join(err, p.join, p.side_stream, p.stream);
  return signals::finish_after(err, p.ch, out, p.stream);
}

}  // namespace pk::ring_attention_bwd
