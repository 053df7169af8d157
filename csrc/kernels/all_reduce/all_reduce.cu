// all_reduce / reduce_scatter: the host sequences of every mechanism, on the
// caller's stream, rank r of n, epoch e of each channel (all_reduce.h has the
// layout and the summation order).
//
// One-shot (Mechanism::kOneShot, all_reduce): one kernel, one_shot.cu.
// Two-shot (kTwoShot: SM pushes, kCopyEngine: copy-engine pushes):
//   phase 1, channel 1, region: n packed chunk slots. wait_credit; push
//     chunk q of x into slot r of peer q's region, for every peer q; post;
//     wait_posted; reduce chunk r over the ranks into the result (all_reduce:
//     chunk r of out; reduce_scatter: all of out); finish.
//   phase 2 (all_reduce only), channel 2, region: n chunk slots. wait_credit;
//     push our reduced chunk into slot r of every peer's region; post;
//     wait_posted; drain slot q into chunk q of out, for every peer q; finish.
//   Chunk c is reduced once, by rank c, and copied: every rank holds the
//   same bits. reduce_scatter's one-shot is phase 1 (the push of chunk q to
//   rank q is all a one-shot would send).
// Every wait is bounded; a failed wait cannot stop the copies after it
// (pk/signals.h says what keeps that safe); `finish` poisons the result.
#include <cuda_runtime.h>

#include "kernels/all_reduce/all_reduce.h"
#include "pk/copy_rows.h"
#include "pk/cuda_check.h"
#include "pk/signals.h"

namespace pk::all_reduce {

namespace {

bool one_shot(Mechanism m, Kind k) {
  return m == Mechanism::kOneShot && k == Kind::kAllReduce;
}

const char* at(const void* base, uint64_t elems, size_t esize) {
  return static_cast<const char*>(base) + elems * esize;
}
char* at(void* base, uint64_t elems, size_t esize) {
  return static_cast<char*>(base) + elems * esize;
}

// Copies `jobs` with the SMs (ld/st) or with the copy engines (one 1-D copy
// per row, pk/copy_rows.h: CUDA graphs update 1-D memcpy nodes only).
cudaError_t copy(const CopyJobs& jobs, bool engine, const Params& p) {
  if (!engine) return launch_copy_jobs(jobs, p.sm_count, p.stream);
  for (int k = 0; k < jobs.count; ++k) {
    const CopyJob& j = jobs.job[k];
    if (j.rows == 0 || j.row_bytes == 0) continue;
    if (j.rows == 1 || (j.src_pitch == j.row_bytes && j.dst_pitch == j.row_bytes)) {
      PK_CUDA_TRY(cudaMemcpyAsync(j.dst, j.src, j.rows * j.row_bytes, cudaMemcpyDeviceToDevice,
                                  p.stream));
    } else {
      PK_CUDA_TRY(copy_rows(j.dst, j.dst_pitch, j.src, j.src_pitch, j.row_bytes, j.rows,
                            p.stream));
    }
  }
  return cudaSuccess;
}

// What both phases' posts carry: x's rows and row bytes (signals::PostLayout).
signals::PostLayout staged_layout(const Params& p) {
  return {p.geo.rows, p.geo.stride * elem_bytes(p.elem)};
}

// Two-shot phase 1: chunk q of x to rank q, our chunk reduced into the result.
cudaError_t enqueue_reduce_scatter(const Params& p, bool engine) {
  const Channel& ch = p.ch;
  const Geometry& g = p.geo;
  const size_t es = elem_bytes(p.elem);
  const uint64_t slot = g.slot_elems();
  PK_CUDA_TRY(signals::wait_credit(ch, p.stream));
  CopyJobs push;
  for (int k = 1; k < ch.n; ++k) {
    const int q = (ch.rank + k) % ch.n;
    push.job[push.count++] =
        CopyJob{at(p.src, g.off(q), es), at(p.region[q], ch.rank * slot, es), g.stride * es,
                g.len(q) * es, g.rows, g.len(q) * es};
  }
  PK_CUDA_TRY(copy(push, engine, p));
  PK_CUDA_TRY(signals::post(ch, signals::kAllPeers, staged_layout(p), p.skip_post, p.stream));
  PK_CUDA_TRY(signals::wait_posted(ch, signals::kAllPeers, staged_layout(p), p.stream));
  const int r = ch.rank;
  ReduceArgs a{};
  for (int q = 0; q < ch.n; ++q) {
    a.src[q] = q == r ? at(p.src, g.off(r), es) : at(p.region[r], q * slot, es);
    a.src_stride[q] = q == r ? g.stride : g.len(r);
  }
  const bool scatter = p.kind == Kind::kReduceScatter;
  a.dst = scatter ? p.dst : at(p.dst, g.off(r), es);
  a.dst_stride = scatter ? g.len(r) : g.stride;
  a.rows = g.rows;
  a.len = g.len(r);
  a.n = ch.n;
  return launch_reduce(a, p.elem, p.sm_count, p.stream);
}

// Two-shot phase 2 (all_reduce, rows == 1): our reduced chunk to every peer,
// theirs into our result.
cudaError_t enqueue_all_gather(const Params& p, bool engine) {
  const Channel& ch = p.ch2;
  const Geometry& g = p.geo;
  const size_t es = elem_bytes(p.elem);
  const int r = ch.rank;
  PK_CUDA_TRY(signals::wait_credit(ch, p.stream));
  CopyJobs push;
  for (int k = 1; k < ch.n; ++k) {
    const int q = (r + k) % ch.n;
    push.job[push.count++] = CopyJob{at(p.dst, g.off(r), es), at(p.region2[q], r * g.chunk, es),
                                     0, 0, 1, g.len(r) * es};
  }
  PK_CUDA_TRY(copy(push, engine, p));
  PK_CUDA_TRY(signals::post(ch, signals::kAllPeers, staged_layout(p), p.skip_post, p.stream));
  PK_CUDA_TRY(signals::wait_posted(ch, signals::kAllPeers, staged_layout(p), p.stream));
  CopyJobs drain;
  for (int q = 0; q < ch.n; ++q)
    if (q != r)
      drain.job[drain.count++] = CopyJob{at(p.region2[r], q * g.chunk, es), at(p.dst, g.off(q), es),
                                         0, 0, 1, g.len(q) * es};
  return copy(drain, engine, p);
}

uint64_t result_bytes(const Params& p) {
  const uint64_t elems = p.kind == Kind::kReduceScatter ? p.geo.rows * p.geo.len(p.ch.rank)
                                                        : p.geo.rows * p.geo.stride;
  return elems * elem_bytes(p.elem);
}

}  // namespace

size_t phase1_bytes(Mechanism m, Kind k, const Geometry& g, Elem t) {
  if (one_shot(m, k)) return size_t(g.n) * one_shot_slot_bytes(g.rows * g.stride * elem_bytes(t));
  return size_t(g.n) * g.slot_elems() * elem_bytes(t);
}

size_t phase2_bytes(Mechanism m, Kind k, const Geometry& g, Elem t) {
  if (one_shot(m, k) || k != Kind::kAllReduce) return 0;
  return size_t(g.n) * g.chunk * elem_bytes(t);
}

cudaError_t run(const Params& p) {
  if (!is_mechanism(int32_t(p.mechanism)) || !is_kind(int32_t(p.kind)))
    return cudaErrorInvalidValue;  // nothing enqueued
  // One kernel: nothing enqueued before it.
  if (one_shot(p.mechanism, p.kind)) return launch_one_shot(p);
  const signals::Outputs out(p.dst, result_bytes(p), p.poison);
  const bool engine = p.mechanism == Mechanism::kCopyEngine;
  cudaError_t err = enqueue_reduce_scatter(p, engine);
  if (err != cudaSuccess) {
    signals::finish(p.ch, out, p.stream, /*aborted=*/true);  // best effort
    if (p.kind == Kind::kAllReduce)
      signals::finish(p.ch2, out, p.stream, /*aborted=*/true);  // keep channel 2 in step
    return err;
  }
  PK_CUDA_TRY(signals::finish(p.ch, out, p.stream));
  if (p.kind != Kind::kAllReduce) return cudaSuccess;
  return signals::finish_after(enqueue_all_gather(p, engine), p.ch2, out, p.stream);
}

cudaError_t load_kernels() {
  PK_CUDA_TRY(load_reduce_kernels());
  PK_CUDA_TRY(load_one_shot_kernels());
  return load_copy_kernels();
}

}  // namespace pk::all_reduce
