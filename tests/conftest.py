"""Test-session set-up shared by every module."""
import os

import torch

# The Triton interpreter only takes effect if it is on before anything imports triton
# (transformers and torch may import it indirectly), so it is switched on here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
