"""Triton kernels with plain-torch references; ``kernels.ops`` dispatches by device."""
