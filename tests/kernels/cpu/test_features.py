"""kernels.cpu.features: detection, the TLE_CPU_ISA cap (run in child processes, since the
cap must act before torch's first op), CPU counts; engine.worker.cpu_threads: the governor."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.worker.cpu_threads import ThreadGovernor, read_cpu_busy, read_self_ticks
from kernels.cpu import features as cpu_features

REPO = str(Path(__file__).resolve().parents[3])
# What a cap leaves in the environment (this process's own, under a capped test pass).
_CAP_STATE = {cpu_features.ISA_ENV, cpu_features.CAP_MARK_ENV, *cpu_features.CAP_VARIABLES}


def _child(code: str, **env: str) -> dict:
    """Run `code` (which prints one JSON line last) in a fresh interpreter."""
    full_env = {k: v for k, v in os.environ.items() if k not in _CAP_STATE}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=full_env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_detect_matches_proc_cpuinfo():
    features = cpu_features.detect()
    flags = cpu_features._proc_flags()
    if not features.is_x86:
        assert features.isa == features.machine
        return
    assert features.isa == features.detected_isa or os.environ.get("TLE_CPU_ISA")
    assert ("avx2" in flags and "fma" in flags) == (features.detected_isa != "baseline")
    assert ("avx512_bf16" in flags) == (features.detected_isa in ("avx512_bf16", "amx"))
    assert features.native_bf16 == (features.isa in ("avx512_bf16", "amx"))
    assert features.flags <= flags
    assert 1 <= features.num_cpus <= (os.cpu_count() or 1)


@pytest.mark.skipif(not cpu_features.detect().is_x86, reason="ISA caps are defined for x86 only")
def test_cap_reaches_onednn_torch_and_the_native_build():
    """Capped at the SSE baseline, a process sees no AVX flag, tells oneDNN and torch's own
    kernels the same, builds its C kernels for plain x86-64, and still computes right."""
    got = _child("""
        import json, os
        from kernels.cpu import features as cpu_features
        f = cpu_features.detect()
        import torch
        torch.ones(64, 64) @ torch.ones(64, 64)  # torch fixes its capability on first use
        from kernels.cpu import native as cpu_native
        from kernels.torch_ops import decode_attention
        from testing.paged_batch import make_paged_batch
        batch = make_paged_batch([1, 17, 77], [1] * 3, 9, 3, 64, 16, dtype=torch.float32)
        q, kc, vc, tables, _, lens, scale, *_ = batch.attention_args()
        native = cpu_native.decode_attention(q, kc, vc, tables, lens, scale)
        ref = decode_attention(q, kc, vc, tables, lens, scale)
        print(json.dumps({"isa": f.isa, "detected": f.detected_isa, "avx": sorted(
            x for x in f.flags if x.startswith(("avx", "fma", "amx"))),
            "march": f.compile_flags(), "onednn": os.environ["ONEDNN_MAX_CPU_ISA"],
            "mkl": os.environ["MKL_ENABLE_INSTRUCTIONS"],
            "aten": torch.backends.cpu.get_cpu_capability(), "bf16": f.native_bf16,
            "prepack": f.can_prepack_bf16, "native": native is not None,
            "err": float((native - ref).abs().max()) if native is not None else None}))
        """, TLE_CPU_ISA="baseline")
    assert got["isa"] == "baseline" and got["avx"] == []
    assert got["march"][0] == "-march=x86-64" or got["detected"] == "baseline"
    assert got["onednn"] == "SSE41" and got["aten"] == "DEFAULT" and got["mkl"] == "SSE4_2"
    assert not got["bf16"] and not got["prepack"]
    if got["native"]:  # a host without a C compiler runs the torch path
        assert got["err"] < 1e-4


_SHOW_CAP_VARIABLES = """
    import json, os
    from kernels.cpu import features as cpu_features
    f = cpu_features.detect()
    print(json.dumps({"isa": f.isa, **{k: os.environ.get(k) for k in cpu_features.CAP_VARIABLES}}))
    """


@pytest.mark.skipif(not cpu_features.detect().is_x86 or cpu_features.detect().detected_isa == "baseline",
                    reason="needs an x86 CPU above the SSE baseline to cap")
def test_a_child_replaces_the_variables_its_parents_cap_set_and_keeps_the_users():
    """scripts/test.sh's capped pass runs pytest under TLE_CPU_ISA=avx2, whose variables
    the test children inherit; a child capped elsewhere must not read them as the user's."""
    parent = _child("""
        import json, os
        from kernels.cpu import features as cpu_features
        cpu_features.detect()
        print(json.dumps(dict(os.environ)))
        """, TLE_CPU_ISA="baseline")
    assert parent[cpu_features.CAP_MARK_ENV] and parent["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    inherited = {k: parent[k] for k in _CAP_STATE if k in parent}
    # As the capped pass leaves them on an AVX-512 host: another level's values, marked.
    inherited.update(MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2")
    uncapped = _child(_SHOW_CAP_VARIABLES, **{**inherited, "TLE_CPU_ISA": ""})
    assert uncapped == {"isa": cpu_features.detect().detected_isa,
                        **dict.fromkeys(cpu_features.CAP_VARIABLES)}
    recapped = _child(_SHOW_CAP_VARIABLES, **inherited)
    assert recapped == {"isa": "baseline", "ONEDNN_MAX_CPU_ISA": "SSE41",
                        "ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    users_own = _child(_SHOW_CAP_VARIABLES, TLE_CPU_ISA="baseline", MKL_ENABLE_INSTRUCTIONS="AVX")
    assert users_own["MKL_ENABLE_INSTRUCTIONS"] == "AVX" and users_own["ONEDNN_MAX_CPU_ISA"] == "SSE41"


def test_cap_above_the_cpu_changes_nothing_and_bad_caps_are_named():
    got = _child("""
        import json
        from kernels.cpu import features as cpu_features
        f = cpu_features.detect()
        print(json.dumps({"isa": f.isa, "detected": f.detected_isa, "capped": f.capped}))
        """, TLE_CPU_ISA="amx")
    assert got["isa"] == got["detected"] and not got["capped"]
    out = subprocess.run([sys.executable, "-c", "from kernels.cpu import features; features.detect()"],
                         cwd=REPO, env={**os.environ, "TLE_CPU_ISA": "avx3"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "TLE_CPU_ISA" in out.stderr and "avx2" in out.stderr


def test_usable_cpus_follow_the_affinity_mask():
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a CPU affinity API and at least 2 CPUs")
    got = _child("""
        import json, os
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from kernels.cpu import features as cpu_features
        import torch
        from engine.worker.cpu_threads import configure_threads
        configure_threads(0, cpu_features.detect().num_cpus, "cpu")
        print(json.dumps({"cpus": cpu_features.detect().num_cpus,
                          "threads": torch.get_num_threads()}))
        """)
    assert got == {"cpus": 1, "threads": 1}


@pytest.mark.parametrize("text, expected", [("max 100000", None), ("150000 100000", 1.5),
                                            ("400000 100000", 4.0)])
def test_cgroup_v2_quota(tmp_path, monkeypatch, text, expected):
    (tmp_path / "cpu.max").write_text(text + "\n")
    monkeypatch.setattr(cpu_features, "_CGROUP_FILES",
                        ((str(tmp_path / "cpu.max"), None),))
    assert cpu_features.cgroup_cpu_limit() == expected


def test_proc_readers_on_this_host():
    busy = read_cpu_busy(frozenset(os.sched_getaffinity(0)))
    own = read_self_ticks()
    assert busy is not None and busy > 0 and own is not None and own >= 0


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_governor_gives_up_threads_to_a_busy_neighbour_and_takes_them_back():
    """Fed /proc-like counters: 100 ticks a second per CPU. We use ~1 CPU ourselves; a
    neighbour's load on our CPUs comes and goes."""
    clock, state = _Clock(), {"busy": 0, "own": 0}
    gov = ThreadGovernor(max_threads=4, cpus=frozenset(range(4)), clock=clock,
                         read_busy=lambda cpus: state["busy"], read_self=lambda: state["own"],
                         ticks_per_s=100.0)

    def second(own_cpus: float, neighbour_cpus: float):
        clock.now += 1.0
        state["own"] += int(100 * own_cpus)
        state["busy"] += int(100 * (own_cpus + neighbour_cpus))
        return gov.update()

    assert gov.update() is None                # first sample: nothing to compare yet
    assert second(3.9, 0.0) is None            # quiet: all 4 threads stay
    assert second(3.0, 1.0) is None            # one busy neighbour: one sample is not enough
    assert second(3.0, 1.0) == 3               # ... two are: 3 threads
    assert gov.threads == 3
    state["busy"] += 300                       # a burst within the same interval:
    assert gov.update() is None                # sampled at most once per interval
    state["busy"] -= 300
    assert second(2.0, 2.1) is None and second(2.0, 2.1) == 2  # two neighbours
    assert second(2.0, 0.0) is None            # a one-sample lull does not flap back
    assert second(1.0, 2.0) is None
    assert second(2.0, 0.0) is None and second(2.0, 0.0) == 4  # they left
    assert second(1.0, 9.0) is None and second(1.0, 9.0) == 1  # never below one thread
    clock.now += 5.0                           # an idle spell beside a neighbour, then a
    state["own"] += 10                         # step: one long sample is enough
    state["busy"] += 10 + 500 * 2
    assert gov.update() == 2
    single = ThreadGovernor(max_threads=1, cpus=frozenset({0}), clock=clock)
    assert single.update() is None
