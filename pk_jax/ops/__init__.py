"""One module per op: the shard_map-level function and its primitive."""
