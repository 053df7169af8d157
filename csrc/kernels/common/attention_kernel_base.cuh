// What the attention kernels' own skeletons share (the ring forward's
// RingFwdKernel, ring_attention/fwd_kernel.cuh; the block backward's
// BlockBwdKernel, attention_bwd/bwd_kernel.cuh): one load warpgroup beside
// the mainloop's math warpgroups, their register split, and the host side
// of a CUTLASS device kernel (arguments, parameters, grid and block).
// The skeletons derive from it and add their shared storage and
// operator() (cutlass::device_kernel runs them; fmha_launch.cuh).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/arch.h>
#include <cutlass/cutlass.h>
#include <cutlass/kernel_hardware_info.h>

namespace pk::fmha_kernel {

template <class Mainloop, class Epilogue, class TileScheduler, uint32_t kLoadRegs = 24,
          uint32_t kMathRegs = 240>
struct AttentionKernelBase {
  static constexpr int kMathWarpGroups = Mainloop::NumMmaWarpGroups;
  static constexpr int MaxThreadsPerBlock = (1 + kMathWarpGroups) * cutlass::NumThreadsPerWarpGroup;
  static constexpr int MinBlocksPerMultiprocessor = 1;
  using ArchTag = cutlass::arch::Sm90;
  // The SM's 65536 registers: the load warpgroup keeps 24 a thread, each
  // math warpgroup takes 240 (the split the mainloops were tuned for), unless
  // the skeleton asks for another.
  static constexpr uint32_t kLoadRegisters = kLoadRegs;
  static constexpr uint32_t kMathRegisters = kMathRegs;
  static_assert((kLoadRegisters + kMathWarpGroups * kMathRegisters) *
                        cutlass::NumThreadsPerWarpGroup <= 65536,
                "the register split exceeds the SM's registers");

  // Five extents; each skeleton says which (forward: B, Hq, Sq, Skv, D).
  using ProblemShape = cute::tuple<int, int, int, int, int>;

  struct Arguments {
    ProblemShape problem_size;
    typename Mainloop::Arguments mainloop;
    typename Epilogue::Arguments epilogue;
    cutlass::KernelHardwareInfo hw_info;
  };

  struct Params {
    ProblemShape problem_size;
    typename Mainloop::Params mainloop;
    typename Epilogue::Params epilogue;
    typename TileScheduler::Params tile_scheduler;
  };

  static bool can_implement(Arguments const& a) {
    return Mainloop::can_implement(a.problem_size, a.mainloop);
  }

  static Params to_underlying_arguments(Arguments const& a, void* workspace) {
    return Params{a.problem_size,
                  Mainloop::to_underlying_arguments(a.problem_size, a.mainloop, workspace),
                  Epilogue::to_underlying_arguments(a.problem_size, a.epilogue, workspace),
                  TileScheduler::to_underlying_arguments(a.problem_size, a.hw_info,
                                                         cute::Shape<cute::_1, cute::_1, cute::_1>{},
                                                         typename Mainloop::TileShape{})};
  }

  static dim3 get_grid_shape(Params const& p) { return TileScheduler::get_grid_shape(p.tile_scheduler); }
  static dim3 get_block_shape() { return dim3(MaxThreadsPerBlock, 1, 1); }
};

}  // namespace pk::fmha_kernel
