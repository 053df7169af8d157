"""Checks of the static arguments every op shares (ints, bools, axes,
dtypes): each error names the op, the argument, what it got and what is
supported. Each op calls them from the one place it validates its config."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

INT32_MAX = (1 << 31) - 1


def integer(op: str, name: str, value, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """`value` as an int: a Python or NumPy integer (a bool, a float or a
    string is a TypeError), within [minimum, maximum] (a ValueError)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"pk_jax.{op}: {name} must be an int, got {value!r} "
                        f"({type(value).__name__})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        want = (f">= {minimum}" if maximum is None else f"<= {maximum}" if minimum is None
                else f"in {minimum}..{maximum}")
        raise ValueError(f"pk_jax.{op}: {name} must be {want}, got {value}")
    return value


def boolean(op: str, name: str, value) -> bool:
    """`value` as a bool: only True or False (a string such as "no" is truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"pk_jax.{op}: {name} must be a bool (True or False), got {value!r} "
                        f"({type(value).__name__})")
    return bool(value)


def axis(op: str, name: str, value, ndim: int, of: str) -> int:
    """An axis `value` of `of` (e.g. "a rank-2 input"), which has `ndim`
    axes, normalized to 0..ndim-1 (negative counts from the end)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"pk_jax.{op}: {name} must be an int (an axis of {of}), got "
                        f"{value!r} ({type(value).__name__})")
    if not -ndim <= value < ndim:
        valid = f"{-ndim}..{ndim - 1}" if ndim else "none: it has no axes"
        raise ValueError(f"pk_jax.{op}: {name}={value} out of range for {of} (valid: {valid})")
    return int(value) % ndim


def dtype(op: str, name: str, value, allowed=None) -> np.dtype:
    """`value` (a dtype, a scalar type or a dtype name) as a NumPy dtype: a
    dtype of numbers (bool, integer, floating, complex; the callers take
    None themselves), or one of `allowed` when given; a TypeError naming the
    argument and what it takes otherwise."""
    try:
        got = jnp.dtype(value)
    except TypeError:
        got = None
    if allowed is None:
        if got is not None and (got == np.bool_ or jnp.issubdtype(got, np.number)):
            return got
        want = "a dtype of numbers (bool, integer, floating or complex, e.g. jnp.float32) or None"
    else:
        names = [jnp.dtype(a).name for a in allowed]
        if got is not None and got in names:
            return got
        want = ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]
    raise TypeError(f"pk_jax.{op}: {name} must be {want}, got {value!r}")
