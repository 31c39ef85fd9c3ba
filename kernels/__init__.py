"""Kernels for the engine's models and sampler (contract: docs/CONTRACTS.md).

Everything the engine runs goes through kernels.dispatch, re-exported here: paged
attention and KV writes, add_rms_norm, silu_mul, rope, argmax_rows, and the Linear
layers' matmuls (prepare_linear lays a loaded weight out once, linear picks GGUF, the
native few-row kernel, oneDNN's prepacked GEMM or F.linear). Dispatch picks Triton on
CUDA (where a kernel exists), the native C kernels on CPU (where they handle the case),
and otherwise the torch implementations in kernels.torch_ops, which define the
semantics. cpu_features (feature detection) is the one other module the engine uses.
"""
from kernels.dispatch import (LinearWeight, add_rms_norm, argmax_rows, linear, paged_attention,
                              prepare_linear, reshape_and_cache, rope, silu_mul)

__all__ = ["LinearWeight", "add_rms_norm", "argmax_rows", "linear", "paged_attention",
           "prepare_linear", "reshape_and_cache", "rope", "silu_mul"]
