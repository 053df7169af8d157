// Every FFI handler symbol the extension exports (one per op).
#pragma once

#include "xla/ffi/api/api.h"

namespace pk::ffi_handlers {

XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeExchange);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MatmulReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherMatmulBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MatmulReduceScatterBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MatmulAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllGatherMatmulFp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MatmulReduceScatterFp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MatmulAllReduceFp8);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RingAttention);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBlockBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RingAttentionBwd);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedMatmul);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8Quantize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8Matmul);

}  // namespace pk::ffi_handlers
