"""bench/malloc_stats.py: glibc's figures that tell a leak (in use grows) from memory
freed but kept by the arenas, which the in-process soak reports beside RssAnon."""
from __future__ import annotations

import pytest

from bench.malloc_stats import MIB, malloc_stats, malloc_trim, rss_anon_bytes

pytestmark = pytest.mark.skipif(malloc_stats() is None, reason="libc without mallinfo2")


def test_a_block_above_the_mmap_threshold_is_counted_while_held_and_gone_after():
    # 64 MiB is over glibc's largest dynamic mmap threshold (32 MiB on 64-bit), so it is
    # always its own mapping, whatever this process allocated before.
    before = malloc_stats()
    block = bytearray(64 * MIB)
    held = malloc_stats()
    assert held.mmapped - before.mmapped >= 64 * MIB
    del block
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
