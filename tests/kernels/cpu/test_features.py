"""kernels.cpu.features: detection, the TLE_CPU_ISA cap (run in child processes, since the
cap must act before torch's first op), CPU counts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
