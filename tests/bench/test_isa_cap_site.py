"""bench/isa_cap_site: a capped benchmark's vLLM peer sees no CPU feature above the cap, and
loads the kernels vLLM loads on a CPU of that level (its _C_AVX2 build under avx2)."""
import json
import os
import subprocess
import sys

import pytest

from bench.peer_runs import ISA_CAP_SITE
from kernels.cpu import features as cpu_features
from tests.vllm_side import vllm_side  # noqa: F401  (the fixture)

PROBES = {"_is_avx512_supported": "avx512", "_is_avx512_bf16_supported": "avx512_bf16",
          "_is_amx_tile_supported": "amx"}
READ_PROBES = ("import json, torch.cpu; print(json.dumps({p: bool(getattr(torch.cpu, p)()) "
               f"for p in {sorted(PROBES)!r}}}))")
LEVELS = cpu_features.X86_LEVELS


def _expected(hardware: dict, cap: str) -> dict:
    return {p: hardware[p] and LEVELS.index(cap) >= LEVELS.index(needs)
            for p, needs in PROBES.items()}


def _probes(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", READ_PROBES], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_features.detect().machine != "x86_64", reason="x86 levels only")
@pytest.mark.parametrize("cap", ["baseline", "avx2", "avx512", "avx512_bf16", "amx"])
def test_site_reports_no_feature_above_the_cap(cap):
    base = {k: v for k, v in os.environ.items() if k not in ("TLE_CPU_ISA", "PYTHONPATH")}
    hardware = _probes(base)
    capped = _probes(dict(base, TLE_CPU_ISA=cap, PYTHONPATH=str(ISA_CAP_SITE)))
    assert capped == _expected(hardware, cap)
    # Without the cap the site changes nothing.
    assert _probes(dict(base, PYTHONPATH=str(ISA_CAP_SITE))) == hardware


VLLM_KERNELS = """
import json, torch.cpu
from vllm.platforms.cpu import CpuPlatform
CpuPlatform.import_kernels()
maps = open("/proc/self/maps").read()
loaded = sorted({n for n in ("_C.abi3.so", "_C_AVX512.abi3.so", "_C_AVX2.abi3.so")
                 if "/vllm/" + n in maps})
print(json.dumps({"loaded": loaded, "avx512": bool(torch.cpu._is_avx512_supported())}))
"""


@pytest.mark.skipif(cpu_features.detect().machine != "x86_64", reason="x86 levels only")
def test_capped_vllm_loads_the_avx2_kernels(vllm_side):
    got = vllm_side.run(VLLM_KERNELS, timeout=180,
                        env={"TLE_CPU_ISA": "avx2", "PYTHONPATH": str(ISA_CAP_SITE)})
    assert got == {"loaded": ["_C_AVX2.abi3.so"], "avx512": False}
