"""bench/soak_rss.py: the slope the timed soak reports, and its /proc reading."""
from __future__ import annotations

import math
import os

from bench.soak_rss import rss_bytes, slope_mib_per_10min, stubs_rss_bytes

MIB = 1024 * 1024


def test_slope_skips_the_warm_up_and_scales_to_ten_minutes():
    # 100 MiB of warm-up growth, then +2 MiB every 30 s: 40 MiB per 10 minutes.
    samples = [(t * 30.0, (t * 50 if t < 3 else 150 + 2 * (t - 3)) * MIB) for t in range(40)]
    assert math.isclose(slope_mib_per_10min(samples, after_s=90.0), 40.0, rel_tol=1e-9)
    assert slope_mib_per_10min(samples, after_s=0.0) > 40.0  # the warm-up tilts it
    assert math.isnan(slope_mib_per_10min(samples[:5], after_s=90.0))  # under 3 samples


def test_rss_reads_this_process_and_no_stub_in_its_group():
    assert rss_bytes(os.getpid()) > rss_bytes(os.getpid(), "RssAnon") > 0
    assert stubs_rss_bytes(os.getpgrp()) == 0  # pytest's group runs no backend stub
