"""Kernels for the engine's models and sampler (contract: docs/CONTRACTS.md).

Everything the engine runs goes through kernels.dispatch, re-exported here: paged
attention and KV writes, add_rms_norm, silu_mul, rope and argmax_rows. Dispatch picks
Triton on CUDA (where a kernel exists), the native C kernels on CPU (where they handle
the case), and otherwise the torch implementations in kernels.torch_ops, which define
the semantics. cpu_features (feature detection) is the one other module the engine uses.
"""
from kernels.dispatch import (add_rms_norm, argmax_rows, paged_attention, reshape_and_cache,
                              rope, silu_mul)

__all__ = ["add_rms_norm", "argmax_rows", "paged_attention", "reshape_and_cache", "rope",
           "silu_mul"]
