"""pk_jax: ParallelKittens-style fused multi-GPU kernels for JAX.

Ops are called inside `jax.shard_map`; `dot_general`, `matmul` and
`dot_product_attention` are called from plain `jax.jit` programs on sharded
arrays and run the fused ops where the shardings call for them
(`pk_jax.partitioning`). On CUDA GPUs they run pk_jax kernels
that read and write peer GPUs' memory directly; on other platforms (and for
shapes the kernels do not take) they run their pure-lax reference.

Public API: the names exported here (`__all__`), by `pk_jax.flax` and by
`pk_jax.partitioning`, and `python -m pk_jax.launch`. Not public API, free to
change between versions: the primitive modules (`pk_jax.ops.<op>.primitive`
and `pk_jax.ops.<op>.*_primitive`: primitives, their configs and FFI
lowerings) and every module or name that starts with an underscore
(`pk_jax._channels`, `pk_jax.ops._lowering`, `pk_jax.flax._common`, ...;
`pk_jax._build_info` is there to be printed when diagnosing an install, not
imported by programs).
"""

from pk_jax._compat import check_jax_version

check_jax_version()

from pk_jax import distributed  # noqa: E402
from pk_jax.config import Config, configure, configured, get_config
from pk_jax._warnings import PkJaxFallbackWarning
from pk_jax.errors import PkJaxError, PkJaxTimeoutError
from pk_jax.ops.all_gather import all_gather
from pk_jax.ops.all_reduce import all_reduce, reduce_scatter
from pk_jax.ops.all_to_all import all_to_all
from pk_jax.ops.fp8 import (Fp8Recipe, fp8_dot, fp8_matmul, fp8_quantize, quantize_activation,
                            quantize_weight)
from pk_jax.ops.fp8 import Fp8Activation, Fp8Weight
from pk_jax.ops.grouped_matmul import grouped_matmul
from pk_jax.ops.moe import MoeLayout, moe_combine, moe_dispatch
from pk_jax.ops.ring_attention import ring_attention
from pk_jax.ops.ring_attention import zigzag_shard, zigzag_unshard
from pk_jax.ops.tp_matmul import all_gather_matmul, matmul_reduce_scatter
from pk_jax.ops.tp_matmul import matmul_all_reduce
from pk_jax.partitioning import dot_general, dot_product_attention, matmul
from pk_jax.runtime import check_errors

__version__ = "0.1.0"

__all__ = [
    "Config",
    "Fp8Activation",
    "Fp8Recipe",
    "Fp8Weight",
    "PkJaxError",
    "PkJaxFallbackWarning",
    "PkJaxTimeoutError",
    "all_gather",
    "all_reduce",
    "all_gather_matmul",
    "all_to_all",
    "MoeLayout",
    "moe_combine",
    "moe_dispatch",
    "check_errors",
    "configure",
    "configured",
    "dot_general",
    "distributed",
    "dot_product_attention",
    "fp8_dot",
    "fp8_matmul",
    "fp8_quantize",
    "get_config",
    "grouped_matmul",
    "matmul",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "quantize_activation",
    "quantize_weight",
    "reduce_scatter",
    "ring_attention",
    "zigzag_shard",
    "zigzag_unshard",
]
