"""glibc's allocator figures for this process, through ctypes: how much of RssAnon is
memory in use (uordblks + hblkhd) and how much is freed but kept (fordblks), and
malloc_trim to give the kept part back. None / no-ops where libc has no mallinfo2
(musl, macOS, glibc < 2.33)."""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@dataclass(frozen=True, slots=True)
class MallocStats:
    arena: int  # bytes the arenas took from the OS with brk/mmap'd heaps (all arenas)
    in_use: int  # uordblks: allocated from the arenas
    free_kept: int  # fordblks: freed into the arenas, not returned
    mmapped: int  # hblkhd: big blocks mmap'd one by one (returned on free)


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc


_LIBC = _libc()


def malloc_stats() -> MallocStats | None:
    if _LIBC is None:
        return None
    info = _LIBC.mallinfo2()
    return MallocStats(info.arena, info.uordblks, info.fordblks, info.hblkhd)


def malloc_trim() -> bool:
    """Returns freed arena memory to the OS (every arena, glibc >= 2.8); whether it did."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))


def rss_anon_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0
