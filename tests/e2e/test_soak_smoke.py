"""bench.soak at a small scale against its own real tritonserver: every phase runs and
its checks hold (outputs equal the in-process engine's, nothing leaks, the excess of a
burst is refused and counted, the crowd behind the probe really waits)."""
from __future__ import annotations

import pytest

from bench.soak import PHASES, SoakConfig, format_summary, run_soak
from bench.soak_requests import bad_requests

pytestmark = pytest.mark.slow

STREAMS, QUEUE_LEN, WAITING = 24, 4, 100


def test_soak_phases_hold_at_small_scale():
    # Bursts of 40 move RSS less than its noise: memory growth is the full-scale run's figure.
    summary = run_soak(SoakConfig(streams=STREAMS, bad_rounds=1, overload_queue_len=QUEUE_LEN,
                                  overload_rss_floor_mib=64, overload_warm_bursts=1, probe_waiting=WAITING, probe_tokens=300))
    print(format_summary(summary))
    assert [p.phase for p in summary.phases] == list(PHASES)
    for phase in summary.phases:
        assert phase.failures == [] and phase.errors == 0 and phase.mismatches == 0, phase
        assert phase.leaked_kv == 0, phase
    assert summary.ok
    load, cancel, bad, overload, probe = summary.phases
    assert load.requests == STREAMS and load.itl_p50_ms > 0
    assert cancel.figures["cancelled"] > 0
    assert bad.figures["bad_refused"] == len(bad_requests(max_model_len=512))
    assert overload.figures["refused"] >= overload.requests * 7 / 10
    assert overload.figures["rejected_counter"] == overload.figures["refused"]
    assert overload.figures["served"] + overload.figures["refused"] == overload.requests
    assert probe.figures["peak_waiting"] == WAITING and probe.figures["loaded_gaps"] >= 20
