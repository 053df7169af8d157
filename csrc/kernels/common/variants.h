// How every kernel family compiled once per instantiation (the GEMM, the ring
// attention forward, the block backward) is declared, instantiated and
// dispatched.
//
//   * The op's host header declares the family: a class template over the
//     instantiation's compile-time parameters, with the runtime key it serves
//     and its two entry points (defined in the op's *_sm90.cuh):
//       template <DType kType, int kHeadDim> struct XVariant {
//         static constexpr XKey key{kType, kHeadDim};
//         static cudaError_t check(const Args&);   // what launch() would refuse
//         static cudaError_t launch(const Args&);
//         static cudaError_t load();  // on the current device, at init
//       };
//     check() lets a host sequence refuse a call before it enqueues anything
//     (a sequence that stopped halfway would leave the peers' protocol behind).
//   * One file per instantiation (they compile in parallel), in the op's
//     instantiations/ folder, holds one explicit instantiation:
//     template struct pk::op::XVariant<...>; (CMakeLists.txt leaves that
//     folder out of a build without CUTLASS)
//   * The op's host file names every instantiation once, in a Built list
//     (a Variants list where the build has CUTLASS, an empty one where not):
//     launch() runs the one whose key equals the runtime key, load() loads
//     them all; with no instantiations launch() and check() refuse
//     (cudaErrorNotSupported) and load() does nothing, so the host files need
//     no #ifdef of their own.
#pragma once

#include <cuda_runtime.h>

namespace pk::variants {

template <class... Vs>
struct Variants {
  // The instantiation for `key`; cudaErrorNotSupported when none serves it.
  template <class Key, class... Args>
  static cudaError_t launch(const Key& key, const Args&... args) {
    cudaError_t err = cudaErrorNotSupported;
    (void)((Vs::key == key ? (err = Vs::launch(args...), true) : false) || ...);
    return err;
  }

  // The instantiation's check() for `key`: cudaSuccess when launch() with
  // the same arguments would not refuse them.
  template <class Key, class... Args>
  static cudaError_t check(const Key& key, const Args&... args) {
    cudaError_t err = cudaErrorNotSupported;
    (void)((Vs::key == key ? (err = Vs::check(args...), true) : false) || ...);
    return err;
  }

  // Every instantiation's load(), stopping at the first error.
  static cudaError_t load() {
    cudaError_t err = cudaSuccess;
    (void)(((err = Vs::load()) != cudaSuccess) || ...);
    return err;
  }
};

// The one build switch of the CUTLASS-based families (PK_HAVE_CUTLASS, set by
// CMakeLists.txt where the headers were found).
#ifdef PK_HAVE_CUTLASS
inline constexpr bool kHaveCutlass = true;
template <class... Vs>
using Built = Variants<Vs...>;
#else
inline constexpr bool kHaveCutlass = false;
template <class... Vs>
using Built = Variants<>;  // the instantiations' files are not built
#endif

}  // namespace pk::variants
