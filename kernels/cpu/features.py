"""What this CPU computes natively: the one place that weight prepacking, the native
kernels' build, dtype "auto" and the load log ask.

Hosts differ from run to run (AMX, AVX-512 with BF16, AVX2 only: a hypervisor may hide
AVX-512), so nothing may assume a feature. `TLE_CPU_ISA` caps the level a process uses
(`baseline`, `avx2`, `avx512`, `avx512_bf16`, `amx`), so a test or a user can behave as
a lesser CPU on a better one: the cap also reaches oneDNN (`ONEDNN_MAX_CPU_ISA`), MKL
(`MKL_ENABLE_INSTRUCTIONS`) and torch's own vector kernels (`ATEN_CPU_CAPABILITY`), which
read those variables once, at their first use, so `detect()` must run before the first
tensor op (the engine calls it before it loads a model, the tests on import).

A capped process's children inherit those variables. `TLE_CPU_ISA_SET` names the ones a
cap set, so a child with another cap (or none) replaces them, while a variable the user
set is never touched.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache

ISA_ENV = "TLE_CPU_ISA"
X86_LEVELS = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
# Flags a level needs on top of the level below it.
_NEEDS = {
    "avx2": {"avx", "avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16"},
    "amx": {"amx_tile", "amx_bf16"},
}
# Flags a capped process must not count on: everything that belongs to a higher level.
_FLAG_LEVEL = (("amx", "amx"), ("avx512_bf16", "avx512_bf16"), ("avx512", "avx512"),
               ("avx_vnni", "avx512"), ("avx_ne_convert", "avx512"), ("avx_ifma", "avx512"),
               ("avx", "avx2"), ("fma", "avx2"), ("f16c", "avx2"))
_ONEDNN_ISA = {"baseline": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE",
               "avx512_bf16": "AVX512_CORE_BF16", "amx": "AVX512_CORE_AMX"}
_MKL_INSTRUCTIONS = {"baseline": "SSE4_2", "avx2": "AVX2", "avx512": "AVX512",
                     "avx512_bf16": "AVX512"}
_ATEN_CAPABILITY = {"baseline": "default", "avx2": "avx2", "avx512": "avx512",
                    "avx512_bf16": "avx512", "amx": "avx512"}
# The libraries' own variables a cap sets, each with its value per level.
CAP_VARIABLES = {"ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA, "ATEN_CPU_CAPABILITY": _ATEN_CAPABILITY,
                 "MKL_ENABLE_INSTRUCTIONS": _MKL_INSTRUCTIONS}
CAP_MARK_ENV = "TLE_CPU_ISA_SET"
# gcc's micro-architecture levels (gcc >= 11) for a capped build; -mtune keeps scheduling
# tuned to the real core.
_MARCH = {"baseline": ["-march=x86-64"], "avx2": ["-march=x86-64-v3"],
          "avx512": ["-march=x86-64-v4"], "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16"]}


@dataclass(frozen=True, slots=True)
class CpuFeatures:
    machine: str           # platform.machine(): x86_64, aarch64, ...
    flags: frozenset[str]  # /proc/cpuinfo flags this process may use (the cap applied)
    isa: str               # the level in use: an X86_LEVELS name, or the machine's name
    detected_isa: str      # the level the CPU has, before any cap
    num_cpus: int          # CPUs this process may run on (affinity mask and cgroup quota)

    @property
    def is_x86(self) -> bool:
        return self.machine in ("x86_64", "AMD64", "i686")

    @property
    def capped(self) -> bool:
        return self.isa != self.detected_isa

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware (AMX, AVX-512 BF16, Arm BF16): bf16 weights run
        at least as fast as fp32 and move half the bytes. Elsewhere bf16 is emulated."""
        if self.is_x86:
            return self.isa in ("avx512_bf16", "amx")
        return "bf16" in self.flags

    @property
    def can_prepack_bf16(self) -> bool:
        """oneDNN's blocked bf16 weight layout (torch's check: AVX512 BW/VL/DQ or
        AVX-NE-CONVERT); without it `_reorder_linear_weight` raises."""
        return self.is_x86 and (_NEEDS["avx512"] <= self.flags or "avx_ne_convert" in self.flags)

    def compile_flags(self) -> list[str]:
        """Target flags for the native kernels: the whole CPU, or exactly the capped level."""
        if not self.is_x86:
            return ["-mcpu=native"]
        if not self.capped:
            return ["-march=native"]
        return [*_MARCH[self.isa], "-mtune=native"]

    def describe(self) -> str:
        cap = f", capped by {ISA_ENV} from {self.detected_isa}" if self.capped else ""
        return f"{self.isa}{cap}, {self.num_cpus} CPUs"


def _proc_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _x86_level(flags: frozenset[str]) -> str:
    level = "baseline"
    for name in X86_LEVELS[1:]:
        if not _NEEDS[name] <= flags:
            break
        level = name
    return level


def _allowed(flag: str, isa: str) -> bool:
    for prefix, level in _FLAG_LEVEL:
        if flag.startswith(prefix):
            return X86_LEVELS.index(level) <= X86_LEVELS.index(isa)
    return True


# cgroup v2's "quota period" file, then v1's two files.
_CGROUP_FILES = (("/sys/fs/cgroup/cpu.max", None),
                 ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def cgroup_cpu_limit() -> float | None:
    """The container's CPU quota in CPUs, None when unlimited."""
    for quota_file, period_file in _CGROUP_FILES:
        try:
            with open(quota_file, encoding="ascii") as f:
                fields = f.read().split()
            if period_file is not None:
                with open(period_file, encoding="ascii") as f:
                    fields.append(f.read().strip())
        except OSError:
            continue
        if len(fields) >= 2 and fields[0] not in ("max", "-1"):
            return int(fields[0]) / int(fields[1])
        return None
    return None


def affinity_cpus() -> frozenset[int]:
    """The CPUs this process may run on (all of them where there is no affinity API)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """CPUs the process may use: its affinity mask, further limited by a cgroup quota
    (a container given 2.5 CPUs of a 64-core host should run 2 threads, not 64)."""
    count = len(affinity_cpus())
    quota = cgroup_cpu_limit()
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return max(1, count)


@lru_cache(maxsize=1)
def detect() -> CpuFeatures:
    machine = platform.machine()
    flags = _proc_flags()
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if machine not in ("x86_64", "AMD64", "i686"):
        if cap:
            raise ValueError(f"{ISA_ENV}={cap!r}: ISA caps exist for x86 only (this CPU: {machine})")
        return CpuFeatures(machine, flags, machine, machine, usable_cpus())
    detected = _x86_level(flags)
    isa = detected
    if cap and cap not in X86_LEVELS:
        raise ValueError(f"{ISA_ENV}={cap!r}: expected one of {', '.join(X86_LEVELS)}")
    _drop_inherited_cap_variables()
    if cap and X86_LEVELS.index(cap) < X86_LEVELS.index(detected):
        isa = cap
        flags = frozenset(f for f in flags if _allowed(f, isa))
        _set_cap_variables(isa)
    return CpuFeatures(machine, flags, isa, detected, usable_cpus())


def _drop_inherited_cap_variables() -> None:
    """A parent's cap is not this process's: forget what it set (and only that)."""
    for name in os.environ.pop(CAP_MARK_ENV, "").split(","):
        if name in CAP_VARIABLES:
            os.environ.pop(name, None)


def _set_cap_variables(isa: str) -> None:
    # Only where the user has not chosen already: their setting wins.
    set_here = []
    for name, per_level in CAP_VARIABLES.items():
        if name not in os.environ and isa in per_level:
            os.environ[name] = per_level[isa]
            set_here.append(name)
    if set_here:
        os.environ[CAP_MARK_ENV] = ",".join(set_here)
