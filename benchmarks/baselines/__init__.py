"""Baselines that pk_jax's ops are measured against, usable by any benchmark or
example: `baselines.cudnn_ring` (benchmarks/ on sys.path, as the benchmark
scripts run) or `benchmarks.baselines.cudnn_ring` (the repository root on it)."""
