"""Paged KV-cache ops for the engine's models (contract: docs/CONTRACTS.md).

`reshape_and_cache` and `paged_attention` run the torch implementation on CPU tensors
and the Triton kernels on CUDA tensors, with the same signature and semantics.
"""
from kernels.dispatch import paged_attention, reshape_and_cache

__all__ = ["paged_attention", "reshape_and_cache"]
