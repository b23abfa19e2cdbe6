"""Kernel microbenchmarks and tuning-table writers (one GPU): ``python -m benchmarks.kernels.bench``."""
