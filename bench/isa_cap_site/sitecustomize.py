"""Makes a peer's torch report no CPU feature above TLE_CPU_ISA's level (benchmarks only).

The engine's cap (kernels/cpu/features.py) reaches oneDNN, MKL and ATen through their own
variables, which a peer's process inherits. vLLM's CPU build also picks its compiled
kernels (vllm._C for AVX-512 BF16, _C_AVX512, _C_AVX2) and its attention and GEMM paths by
asking torch.cpu._is_*_supported(), which read the hardware; bench/peer_runs.py puts this
folder on a capped peer's PYTHONPATH, so every process it starts loads what it would load
on a CPU of that level."""
import os

# kernels/cpu/features.X86_LEVELS, restated: a peer's venv does not have this project
# (tests/bench/test_isa_cap_site.py holds the two to the same answers at every level).
_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# torch.cpu's probe -> the lowest level that has the feature.
_PROBE_LEVEL = {"_is_avx512_supported": "avx512", "_is_avx512_vnni_supported": "avx512",
                "_is_avx512_bf16_supported": "avx512_bf16", "_is_amx_tile_supported": "amx",
                "_is_amx_fp16_supported": "amx"}


def _cap() -> None:
    level = os.environ.get("TLE_CPU_ISA", "")
    if level not in _LEVELS:
        return
    import torch.cpu
    for probe, needs in _PROBE_LEVEL.items():
        if _LEVELS.index(level) < _LEVELS.index(needs) and hasattr(torch.cpu, probe):
            setattr(torch.cpu, probe, lambda: False)


_cap()
