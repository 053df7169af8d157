// The CUDA runtime's types that host-only checks meet in kernel headers
// (declarations only; nothing here runs). Used by tests that compile a
// header's pure decision functions where the CUDA toolkit is missing; with
// the toolkit, its own cuda_runtime.h is used instead.
#pragma once
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef int cudaError_t;
