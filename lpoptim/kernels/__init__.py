"""Triton kernels: faster implementations of the pure-torch references, one file per family."""
