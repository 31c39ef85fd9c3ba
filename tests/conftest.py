"""Test-session set-up shared by every module."""
import os

import torch
from hypothesis import HealthCheck, settings

from kernels.cpu import features as cpu_features

# The Triton interpreter only takes effect if it is on before anything imports triton
# (transformers and torch may import it indirectly), so it is switched on here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A TLE_CPU_ISA cap (the CI's AVX2 pass) must reach oneDNN and torch's kernels before
# the first tensor op, and the servers the e2e tests start inherit it from here.
cpu_features.detect()

# Hypothesis profiles, registered before any test module builds its @settings (which copy
# the profile loaded at that moment). "ci", the default: derandomized (examples drawn from
# a hash of each test, so a CI failure replays anywhere) and no example database. "explore":
# 10x the examples from fresh random seeds, failures kept in .hypothesis/ for replay; pick it
# with HYPOTHESIS_PROFILE=explore or `pytest --hypothesis-profile=explore`. A test's own
# max_examples still wins: tests that scale with the profile ask for a share of
# settings.default.max_examples instead (tests/engine/core/test_scheduler_properties.py).
settings.register_profile("ci", max_examples=100, derandomize=True, database=None,
                          deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=1000, derandomize=False, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
