"""pk_jax's FP8 matmuls: api.py (recipes, quantization, fp8_matmul, fp8_dot),
stored.py (Fp8Weight, Fp8Activation), primitive.py (the quantization and GEMM
primitives and their FFI lowerings; not public API)."""

from pk_jax.ops.fp8.api import (Fp8Recipe, activation_operands, checked_scales, fp8_dot,
                                fp8_matmul, fp8_quantize, given_scale, marker, max_to_type_of,
                                out_dtype_of, quantize_activation, quantize_block_copies,
                                quantize_weight, recipe_for, residual_copies, residual_marker,
                                scale_cotangents, scale_from_amax, weight_operands)
from pk_jax.ops.fp8.stored import RECIPE_OF, SCALINGS, Fp8Activation, Fp8Weight, is_stored

__all__ = [
    "Fp8Activation", "Fp8Recipe", "Fp8Weight", "RECIPE_OF", "SCALINGS", "activation_operands",
    "checked_scales", "fp8_dot", "fp8_matmul", "fp8_quantize", "given_scale", "is_stored",
    "marker", "max_to_type_of", "out_dtype_of", "quantize_activation", "quantize_block_copies",
    "quantize_weight",
    "recipe_for", "residual_copies", "residual_marker", "scale_cotangents", "scale_from_amax",
    "weight_operands",
]
