// all_gather kernels: host-side interface (run: one call of any mechanism).
//
// Output layout: for every rank q, `rows` rows of `row_bytes` bytes at
// dst + q * row_bytes with row stride n * row_bytes. Gathering along array
// axis k of a C-contiguous array is this layout with rows = prod(shape[:k]).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "pk/channel.h"
#include "pk/layout.h"

namespace pk::all_gather {

// Values of the FFI attribute "mechanism" (pk_jax/ops/all_gather/primitive.py:
// KERNEL_MECHANISMS).
enum class Mechanism : int32_t { kLdStPull = 0, kCopyEngine = 1, kLdStPush = 2, kLdStLl = 3 };
inline bool is_mechanism(int32_t v) {
  return v >= int32_t(Mechanism::kLdStPull) && v <= int32_t(Mechanism::kLdStLl);
}

struct Params {
  Mechanism mechanism = Mechanism::kLdStPull;
  const void* src = nullptr;   // this rank's input (XLA buffer)
  void* dst = nullptr;         // this rank's output (XLA buffer)
  uint64_t rows = 0;
  uint64_t row_bytes = 0;
  Channel ch{};                // the channel's flags on every rank; rank, n
  int slot = 0;                // its index (LL lines: the first kLlChannels)
  char* workspace[kMaxRanks] = {};  // every rank's workspace base (LL lines)
  char* region[kMaxRanks] = {};     // every rank's data region (copy engine)
  bool skip_post = false;      // testing: this rank never posts (timeout path)
  // Every byte of the output of a failed call (one of its waits failed, or
  // the device held an error when it ran): 0xFF, a NaN in every IEEE float
  // type and all bits set in integers; the handler picks 0x80 for the fp8
  // "fnuz" types (their only NaN).
  uint8_t poison = 0xFF;
  int device = 0;              // CUDA ordinal (cached launch limits)
  int num_blocks = 0;          // ld/st grid cap; 0: one block per SM
  cudaStream_t stream = nullptr;
};

// Bytes of data region the copy-engine mechanism stages: n blocks of
// `block_bytes` (one rank's input).
inline size_t copy_engine_bytes(int n, size_t block_bytes) { return size_t(n) * block_bytes; }

// The whole call on p.stream, by p.mechanism (the mechanisms below).
// cudaErrorInvalidValue, with nothing enqueued, for a call that supported()
// refuses.
cudaError_t run(const Params& p);

// Whether run() takes the call: a known mechanism, and for kLdStLl a message
// of up to kLlMaxBytes per rank in whole 4-byte words on one of the first
// kLlChannels channels.
bool supported(const Params& p);

// ---- the mechanisms, one file each (all_gather_<mechanism>.cu), for run() --
// ld/st, zero copy (kLdStPull, kLdStPush). Pull: each rank publishes its
// input address and every rank reads every peer's input straight into its
// output with 16-byte loads. Push: each rank publishes its output address and
// writes its input into every peer's output with 16-byte stores. Grid:
// num_blocks, at most the co-resident blocks found at load; by default one
// block per SM (measured best for large messages).
cudaError_t run_ld_st(const Params& p, bool push);

// Copy engine (kCopyEngine): CE pushes the input into each peer's workspace,
// tiny kernels signal, CE copies the received blocks into the output. No SM
// does the data movement.
cudaError_t run_copy_engine(const Params& p);

// ld/st low latency (kLdStLl): for messages of up to kLlMaxBytes per rank
// with row_bytes a multiple of 4 (supported()). Each rank stores its block as
// flagged lines into every peer's workspace; receivers spin on the lines
// themselves, so a call costs one one-way trip and no handshake.
cudaError_t run_ll(const Params& p);

// Load every all_gather kernel on the current device, so that no lazy module
// load happens while a peer spins (load_kernels), or those of one file; the
// ld/st file also caches the device's grid limits.
cudaError_t load_kernels();
cudaError_t load_ld_st_kernels();
cudaError_t load_ll_kernels();

}  // namespace pk::all_gather
