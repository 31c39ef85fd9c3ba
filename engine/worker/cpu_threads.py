"""How many OpenMP threads the forward pass uses: the CPUs this process may use (affinity
mask, cgroup quota), less those a busy neighbour is taking right now.

Why adapt: torch's parallel ops split work evenly over their threads and end in a
barrier, so one thread that shares its core with another CPU-bound process makes every
op wait for that process's time slice. Measured on 2 cores (AVX2 EPYC) with one busy
neighbour: 2 threads ran several times slower than 1 thread. The governor samples
/proc/stat once a second, counts the CPU time that others spent on our CPUs (steal time
included), and runs on the CPUs left over.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from kernels.dispatch import affinity_cpus

logger = logging.getLogger(__name__)


def read_cpu_busy(cpus: frozenset[int], path: str = "/proc/stat") -> int | None:
    """Busy clock ticks (all but idle and iowait) summed over `cpus`; None if unreadable."""
    try:
        with open(path, encoding="ascii") as stat:
            lines = stat.readlines()
    except OSError:
        return None
    busy = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in rest.split()]
        busy += sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy


def read_self_ticks(path: str = "/proc/self/stat") -> int | None:
    """utime + stime of this whole process, in clock ticks."""
    try:
        with open(path, encoding="ascii") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


def read_running_tasks(path: str = "/proc/loadavg") -> int | None:
    """Tasks runnable on the whole host right now (the caller included)."""
    try:
        with open(path, encoding="ascii") as loadavg:
            return int(loadavg.read().split()[3].partition("/")[0])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class ThreadGovernor:
    """Call `update()` when the engine starts loading (the first sample), once it is
    built, and once per engine step; it samples at most every `interval_s` and changes the count when two
    samples in a row ask for the same new one, or one sample spans two intervals."""
    max_threads: int
    cpus: frozenset[int]
    interval_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    read_busy: Callable[[frozenset[int]], int | None] = read_cpu_busy
    read_self: Callable[[], int | None] = read_self_ticks
    read_running: Callable[[], int | None] = read_running_tasks
    ticks_per_s: float = field(default_factory=lambda: float(os.sysconf("SC_CLK_TCK")))
    threads: int = 0
    _last: tuple[float, int, int] | None = None
    _proposed: int | None = None

    def __post_init__(self) -> None:
        self.threads = self.max_threads

    def adapt(self) -> None:
        """update(), and hand a changed count to torch (on the calling, engine thread)."""
        if (threads := self.update()) is not None:
            import torch
            torch.set_num_threads(threads)

    def update(self) -> int | None:
        """The new thread count when it should change, else None."""
        if self.max_threads <= 1:
            return None
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return None
        busy, own = self.read_busy(self.cpus), self.read_self()
        if busy is None or own is None:
            return None
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return None
        elapsed = (now - last[0]) * self.ticks_per_s
        others = max(0.0, (busy - last[1]) - (own - last[2])) / max(elapsed, 1e-9)
        wanted = max(1, min(self.max_threads, round(len(self.cpus) - others)))
        # Two samples in a row must agree: a burst of the server's own gRPC/IPC threads
        # or a short-lived process should not make the pool flap. A window of two
        # intervals or more (the first step after an idle spell) is averaged enough alone,
        # and acting on it at once matters: the first prefill beside a busy neighbour took
        # 6.3 s on 2 threads (2 cores, AVX2), before any second sample could come.
        proposed, self._proposed = self._proposed, wanted
        long_window = now - last[0] >= 2 * self.interval_s
        if wanted == self.threads or (wanted != proposed and not long_window):
            return None
        if long_window and wanted < self.threads and wanted != proposed:
            # The idle spell's average may describe a neighbour that has since left (a
            # benchmark's peer that just exited, a finished build): then the first second
            # or two of the next burst ran on too few threads (the engine's rounds after
            # a peer ran ~15% slower, 2 cores, AMX host). Act on it alone only while as
            # many other tasks as the CPUs it would give up are runnable now.
            running = self.read_running()
            if running is not None and running - 1 < self.threads - wanted:
                self._proposed = None
                return None
        logger.info("CPU threads %d -> %d: other processes are using %.1f of our %d CPUs",
                    self.threads, wanted, others, len(self.cpus))
        self.threads = wanted
        return wanted


def configure_threads(num_threads: int, usable: int, device: str) -> ThreadGovernor | None:
    """Set torch's thread count on the calling (engine) thread: `num_threads` if given,
    else every usable CPU, adapted while serving by the returned governor."""
    if not device.startswith("cpu"):
        return None
    import torch
    torch.set_num_threads(num_threads or usable)
    if num_threads:
        return None
    governor = ThreadGovernor(usable, affinity_cpus())
    governor.update()  # the first sample: loading and warm-up make the first window
    return governor
