"""bench/malloc_stats.py: glibc's figures that tell a leak (in use grows) from memory
freed but kept by the arenas, which the in-process soak reports beside RssAnon."""
from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from bench.malloc_stats import MIB, malloc_stats, malloc_trim, rss_anon_bytes

pytestmark = pytest.mark.skipif(malloc_stats() is None, reason="libc without mallinfo2")


def test_a_block_above_the_mmap_threshold_is_counted_while_held_and_gone_after():
    # glibc serves a request from the arena's free chunks before it thinks of mmap, so
    # after earlier tests freed big blocks a 64 MiB request can land in the arena. One
    # larger than everything the arenas keep free cannot; it is also over glibc's
    # largest dynamic mmap threshold (32 MiB on 64-bit), so it gets its own mapping.
    # malloc without touching the pages: a big free_kept costs no RSS here.
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = malloc_stats()
    size = before.free_kept + 64 * MIB
    block = libc.malloc(size)
    assert block
    try:
        held = malloc_stats()
        assert held.mmapped - before.mmapped >= size
    finally:
        libc.free(block)
    after = malloc_stats()
    assert after.mmapped - before.mmapped < MIB


def test_small_blocks_count_as_in_use_then_as_freed_and_trim_runs():
    before = malloc_stats()
    blocks = [bytearray(4096) for _ in range(2048)]  # 8 MiB from the arena, not mmap'd
    held = malloc_stats()
    assert held.in_use - before.in_use >= 8 * MIB
    del blocks
    freed = malloc_stats()
    assert held.in_use - freed.in_use >= 8 * MIB
    malloc_trim()  # may or may not find pages to return; it must not break the process
    assert rss_anon_bytes() > 0
