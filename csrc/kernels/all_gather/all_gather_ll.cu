// all_gather, ld/st low-latency (LL) mechanism: one kernel, one one-way trip.
//
// For call epoch e on rank r, with lines of parity p = e & 1:
//   send:    r stores every 4-byte word i of its block as the 8-byte line
//            {word, flag = low 32 bits of e} into line i of "from r, parity p"
//            of every peer's workspace, and its layout (rows, words per row)
//            as the header line {layout, flag} after them (kLlHeaderLine);
//            it copies its block into its output.
//   receive: for each peer q, r checks q's header line (spinning until its
//            flag is e's) against its own layout: another layout (two
//            programs that share the channel ran in different orders) is an
//            error (kErrLayout) and q's lines are not read. Then r spins on
//            the lines "from q, parity p" of its own workspace until their
//            flag is e's, and writes their words into its output.
//   finish:  the last block poisons the output if the device holds an error
//            (a wait of this call failed, or one before it), and advances
//            the epoch.
// No handshake is needed to reuse lines: r writes parity p again at e+2 only
// after receiving q's lines of e+1, which q sends after it finished reading
// the lines of e. A flag can only match once: consecutive uses of one
// parity differ by 2 in the epoch, and the lines start zeroed (e >= 1).
#include <algorithm>

#include "kernels/all_gather/all_gather.h"
#include "pk/copy.cuh"
#include "pk/cuda_check.h"
#include "pk/offer.h"
#include "pk/sync.cuh"

namespace pk::all_gather {
namespace {

// ---- launch config ---------------------------------------------------------
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 16;  // kLlMaxBytes / 4 words over 16 x 256 threads: 1 line each

// ---- arguments -------------------------------------------------------------
struct LlArgs {
  const uint32_t* src;
  uint32_t* dst;
  uint64_t rows;
  uint64_t row_words;
  Channel ch;
  char* lines[kMaxRanks];  // each rank's LL area of this channel
  bool skip_post;
  uint8_t poison;          // byte pattern of a failed call's output
};

// ---- roles -----------------------------------------------------------------
__device__ __forceinline__ uint64_t* lines_of(const LlArgs& a, int owner, int sender,
                                              uint64_t epoch) {
  const size_t index = size_t(epoch & 1) * kMaxRanks + sender;
  return reinterpret_cast<uint64_t*>(a.lines[owner] + index * kLlRankBytes);
}

__device__ void send(const LlArgs& a, const RowBlock<uint32_t>& mine, uint64_t epoch,
                     uint64_t first, uint64_t stride) {
  const uint64_t flag = (epoch & 0xffffffffu) << 32;
  for (int k = 1; k < a.ch.n && !a.skip_post; ++k) {
    uint64_t* out = lines_of(a, (a.ch.rank + k) % a.ch.n, a.ch.rank, epoch);
    if (first == 0)
      store_relaxed_sys(out + kLlHeaderLine, flag | offer::ll_layout(a.rows, a.row_words));
    for (uint64_t i = first; i < mine.size(); i += stride)
      store_relaxed_sys(out + i, flag | mine.src[i]);
  }
  for (uint64_t i = first; i < mine.size(); i += stride) mine.dst[mine.dst_index(i)] = mine.src[i];
}

__device__ void receive(const LlArgs& a, RowBlock<uint32_t> from, uint64_t epoch,
                        uint64_t first, uint64_t stride) {
  const uint32_t flag = uint32_t(epoch);
  const uint32_t layout = offer::ll_layout(a.rows, a.row_words);
  if (first >= from.size()) return;  // no line for this thread
  for (int k = 1; k < a.ch.n; ++k) {
    const int q = (a.ch.rank + a.ch.n - k) % a.ch.n;
    const uint64_t* in = lines_of(a, a.ch.rank, q, epoch);
    from.dst = a.dst + q * from.row_vecs;
    // The first line and the header in flight together: the check adds no
    // round trip when both have landed.
    uint64_t line = load_relaxed_sys(in + first);
    uint64_t head = load_relaxed_sys(in + kLlHeaderLine);
    if (uint32_t(head >> 32) != flag && !wait_line(in + kLlHeaderLine, flag, a.ch.wait, q, &head))
      continue;  // timed out (recorded): skip this peer
    if (uint32_t(head) != layout) {
      const uint32_t theirs = uint32_t(head);
      record_error(a.ch.wait, kErrLayout, q, 0, a.rows, theirs >> 16, a.row_words * 4,
                   uint64_t(theirs & 0xffffu) * 4);
      continue;  // lines cut for another shape: read none
    }
    for (uint64_t i = first; i < from.size(); i += stride) {
      if (i != first) line = load_relaxed_sys(in + i);
      if (uint32_t(line >> 32) != flag) {
        // Bounded wait on this line; give up on the whole peer on timeout.
        if (!wait_line(in + i, flag, a.ch.wait, q, &line)) break;
      }
      from.dst[from.dst_index(i)] = uint32_t(line);
    }
  }
}

__device__ void finish(const LlArgs& a, uint64_t epoch) {
  __shared__ bool is_last;
  SlotFlags* mine = a.ch.mine();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the block's output stores before its ticket
    is_last = atomicAdd(&mine->ticket, 1u) == gridDim.x - 1;
    __threadfence();  // the last block sees every block's work
  }
  __syncthreads();
  if (!is_last) return;
  // Every block is done with the output: a failed call's becomes poison.
  if (__syncthreads_or(threadIdx.x == 0 && device_failed(a.ch.wait)))
    poison_bytes(a.dst, uint64_t(a.ch.n) * a.rows * a.row_words * 4, a.poison, threadIdx.x,
                 blockDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    mine->ticket = 0;
    mine->epoch = epoch;
  }
}

// ---- entry point -----------------------------------------------------------
__global__ void __launch_bounds__(kThreads) all_gather_ll_kernel(
    const __grid_constant__ LlArgs a) {
  const uint64_t epoch = a.ch.next_epoch();
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t dst_stride = uint64_t(a.ch.n) * a.row_words;
  const RowBlock<uint32_t> mine{a.src, a.dst + a.ch.rank * a.row_words, a.rows, a.row_words,
                                dst_stride};
  send(a, mine, epoch, first, stride);
  receive(a, mine, epoch, first, stride);
  finish(a, epoch);
}

}  // namespace

cudaError_t run_ll(const Params& p) {
  LlArgs a{};
  a.src = static_cast<const uint32_t*>(p.src);
  a.dst = static_cast<uint32_t*>(p.dst);
  a.rows = p.rows;
  a.row_words = p.row_bytes / 4;
  a.ch = p.ch;
  for (int q = 0; q < p.ch.n; ++q)
    a.lines[q] = p.workspace[q] + kLlOffset + size_t(p.slot) * kLlChannelBytes;
  a.skip_post = p.skip_post;
  a.poison = p.poison;
  const uint64_t words = p.rows * a.row_words;
  const uint64_t wanted = (words + kThreads - 1) / kThreads;
  const int blocks = int(std::clamp<uint64_t>(wanted, 1, kMaxBlocks));
  all_gather_ll_kernel<<<blocks, kThreads, 0, p.stream>>>(a);
  return cudaGetLastError();
}

cudaError_t load_ll_kernels() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(all_gather_ll_kernel));
}

}  // namespace pk::all_gather
