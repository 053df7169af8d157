// all_reduce / reduce_scatter kernels: host-side interface (run: one call of
// any mechanism).
//
// Layout. The input x holds `rows` rows of `stride` elements. Chunk c (the
// part rank c reduces in the two-shot schedules, and the part of
// reduce_scatter's result rank c keeps) is, in every row, the elements
// [off(c), off(c) + len(c)) with off(c) = min(c * chunk, stride) and
// len(c) = min(chunk, stride - off(c)):
//   all_reduce:     rows = 1, stride = x's element count, chunk = that count
//                   over n rounded up to 16 bytes (the last chunks may be
//                   short or empty);
//   reduce_scatter: rows = prod(shape[:scatter_dimension]), stride = n *
//                   chunk, chunk = the result's elements per row.
// A staged chunk is packed: rows x len(c) elements.
//
// Summation order. Every sum is taken over ranks 0, 1, ..., n-1 in that
// order, in fp32 for 16-bit floats (rounded once to the output type), in the
// type itself for fp32 and int32 (two's complement wraparound). Whichever
// rank computes an element and whichever mechanism runs, the same operations
// in the same order give the same bits: every rank's result is bitwise
// identical.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::all_reduce {

// Element types (the handler maps XLA's; others never reach the kernels).
enum class Elem : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2, kS32 = 3 };
inline size_t elem_bytes(Elem t) { return t == Elem::kF32 || t == Elem::kS32 ? 4 : 2; }

// Values of the FFI attribute "mechanism" (pk_jax/ops/all_reduce/primitive.py).
enum class Mechanism : int32_t {
  kOneShot = 0,     // every rank pushes x into every peer's region, each reduces all of it
  kTwoShot = 1,     // ld/st pushes: reduce-scatter into the owners, then all-gather
  kCopyEngine = 2,  // the same two phases with copy-engine pushes
};
inline bool is_mechanism(int32_t v) {
  return v >= int32_t(Mechanism::kOneShot) && v <= int32_t(Mechanism::kCopyEngine);
}
// Values of the FFI attribute "kind".
enum class Kind : int32_t { kAllReduce = 0, kReduceScatter = 1 };
inline bool is_kind(int32_t v) {
  return v == int32_t(Kind::kAllReduce) || v == int32_t(Kind::kReduceScatter);
}

struct Geometry {
  uint64_t rows = 0;
  uint64_t stride = 0;  // elements per row of x
  uint64_t chunk = 0;   // elements per row of one chunk (the longest)
  int n = 1;

  uint64_t off(int c) const {
    const uint64_t o = uint64_t(c) * chunk;
    return o < stride ? o : stride;
  }
  uint64_t len(int c) const {
    const uint64_t rest = stride - off(c);
    return chunk < rest ? chunk : rest;
  }
  // Bytes of one packed chunk slot (the longest chunk).
  uint64_t slot_elems() const { return rows * chunk; }
};

struct Params {
  Mechanism mechanism = Mechanism::kTwoShot;
  const void* src = nullptr;  // x (XLA buffer)
  void* dst = nullptr;        // the result (XLA buffer)
  Elem elem = Elem::kF32;
  Kind kind = Kind::kAllReduce;
  Geometry geo;
  Channel ch{};               // phase 1 (every mechanism)
  Channel ch2{};              // phase 2: the all-gather of the two-shot all_reduce
  char* region[kMaxRanks] = {};   // every rank's phase-1 region
  char* region2[kMaxRanks] = {};  // every rank's phase-2 region
  bool skip_post = false;     // testing: this rank never posts (timeout path)
  uint8_t poison = 0xFF;      // every byte of a failed call's result
  int sm_count = 132;         // grid of the data kernels
  cudaStream_t stream = nullptr;
};

// Bytes of region each phase stages: n slots (slot q: what rank q sent).
// One-shot: the whole of x per slot; two-shot: one packed chunk per slot.
size_t phase1_bytes(Mechanism m, Kind k, const Geometry& g, Elem t);
size_t phase2_bytes(Mechanism m, Kind k, const Geometry& g, Elem t);

// The whole call on p.stream, by p.mechanism: the fused one-shot kernel
// (kOneShot with kAllReduce), else a stream-ordered sequence of pushes (ld/st
// kernel or copy engine), the signal kernels of pk/signals.h and the
// reduction kernel. A CUDA error from an enqueue finishes the call as aborted
// (result poisoned, epochs in step) and is returned.
cudaError_t run(const Params& p);

// ---- the data kernels (reduce.cu, copy_jobs.cu) ----------------------------
// out[i][j] = sum over q = 0..n-1 of src[q][i * src_stride[q] + j], for rows
// i < rows and j < len (element strides), in the order and precision above.
struct ReduceArgs {
  const void* src[kMaxRanks];
  uint64_t src_stride[kMaxRanks];
  void* dst;
  uint64_t dst_stride;
  uint64_t rows;
  uint64_t len;
  int n;
};
cudaError_t launch_reduce(const ReduceArgs& a, Elem t, int sm_count, cudaStream_t s);

// Up to kMaxRanks strided copies in one launch (SM loads and stores; a
// destination may be a peer's workspace): job k copies `rows` rows of
// `row_bytes` from src (row pitch src_pitch) to dst (row pitch dst_pitch).
struct CopyJob {
  const void* src = nullptr;
  void* dst = nullptr;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
};
struct CopyJobs {
  CopyJob job[kMaxRanks];
  int count = 0;
};
cudaError_t launch_copy_jobs(const CopyJobs& jobs, int sm_count, cudaStream_t s);

// The fused one-shot all_reduce kernel (one_shot.cu): every step of the
// call in one launch; slots of x's bytes rounded up to 16.
cudaError_t launch_one_shot(const Params& p);
uint64_t one_shot_slot_bytes(uint64_t bytes);

// Load every kernel of the family on the current device (load_kernels), or
// those of one file.
cudaError_t load_kernels();
cudaError_t load_reduce_kernels();
cudaError_t load_copy_kernels();
cudaError_t load_one_shot_kernels();

}  // namespace pk::all_reduce
