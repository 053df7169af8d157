"""One module per op: the shard_map-level function (public, re-exported by
pk_jax) and its primitive (`<op>_primitive.py`, not public API)."""
