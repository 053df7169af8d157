"""One package per op family, `pk_jax/ops/<op>/`: `api.py` (the shard_map-level
functions, re-exported by pk_jax), `primitive.py` (and `*_primitive.py`: the
primitives and their FFI lowerings, not public API) and the family's other
modules; each `__init__.py` re-exports the public names of `api.py`. Beside
them: `all_to_all.py` (one function over `lax.all_to_all`, no primitive yet)
and `_lowering.py` (what every primitive's lowering shares)."""
