"""GGUF block weights for kernel tests: random values quantized by the gguf package."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import quants

from kernels.gguf_weight import GgufWeight


def gguf_weight(type_name: str, out_features: int, in_features: int, seed: int = 0):
    """Random weights quantized by the gguf package -> (GgufWeight, the package's dequantized
    float32 values)."""
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((out_features, in_features)) * 0.05
             + rng.standard_normal((out_features, 1)) * 0.01).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    blocks = quants.quantize(dense, qtype)
    expected = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32))
    return GgufWeight.from_blocks(type_name, torch.from_numpy(blocks.copy()), in_features), expected
