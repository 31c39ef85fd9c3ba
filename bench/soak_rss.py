"""RSS of tritonserver's python backend stubs, sampled on a thread, and its slope."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

STUB = b"triton_python_backend_stub"


def stub_pids(pgid: int) -> list[int]:
    """The stubs in tritonserver's process group (they join it; see backend/triton_server)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the parenthesised command: state ppid pgrp ...
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            if STUB in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return pids


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def stubs_rss_bytes(pgid: int, field: str = "VmRSS") -> int:
    """VmRSS, or RssAnon: what the process allocated, without the file-backed pages (the
    mmap'd weights) that a loaded host's page cache takes back and gives again."""
    total = 0
    for pid in stub_pids(pgid):
        try:
            total += rss_bytes(pid, field)
        except OSError:
            continue  # gone between the listing and the read
    return total


class RssSampler:
    """On enter samples at once, then every `every_s`, and once more on exit."""

    def __init__(self, pgid: int, every_s: float) -> None:
        self.pgid = pgid
        self.every_s = every_s
        self.samples: list[tuple[float, int]] = []  # (seconds, VmRSS bytes)
        self.anon: list[tuple[float, int]] = []  # (seconds, RssAnon bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._started = 0.0

    def _sample(self) -> None:
        now = time.monotonic() - self._started
        self.samples.append((now, stubs_rss_bytes(self.pgid)))
        self.anon.append((now, stubs_rss_bytes(self.pgid, "RssAnon")))

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> "RssSampler":
        self._started = time.monotonic()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def slope_mib_per_10min(samples: list[tuple[float, int]], after_s: float) -> float:
    """Least-squares slope of the samples taken after `after_s`; nan under 3 of them."""
    kept = [(t, b) for t, b in samples if t >= after_s]
    if len(kept) < 3:
        return float("nan")
    seconds, values = np.array(kept, dtype=np.float64).T
    return float(np.polyfit(seconds, values / (1024 * 1024), 1)[0] * 600.0)
