"""Test-session set-up shared by every module."""
import os

import torch

from kernels.cpu import features as cpu_features

# The Triton interpreter only takes effect if it is on before anything imports triton
# (transformers and torch may import it indirectly), so it is switched on here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A TLE_CPU_ISA cap (the CI's AVX2 pass) must reach oneDNN and torch's kernels before
# the first tensor op, and the servers the e2e tests start inherit it from here.
cpu_features.detect()
