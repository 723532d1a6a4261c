"""The harness's own memory helpers (harness/probes/machine_health/selfmem.py) on this glibc machine."""

from __future__ import annotations

import gc
import os
import platform

import pytest

from harness.probes.machine_health import selfmem
from harness.probes.workers.leaks import read_process


def test_python_blocks_counts_live_objects_and_falls_when_they_are_freed():
    before = selfmem.python_blocks()
    held = [bytearray(64) for _ in range(100_000)]
    during = selfmem.python_blocks()
    del held
    gc.collect()
    after = selfmem.python_blocks()
    assert during - before >= 100_000
    assert after < during - 90_000


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_trim_hands_freed_memory_back_to_the_system():
    """Many small frees leave pages in the allocator (no single free returns them); trim gives them back.
    Planted: trim() a no-op -> ``trimmed`` stays at ``grown``. The heap is trimmed before ``base``: free pages
    left by earlier tests in this process would otherwise be reused unseen (CI under -n 2: grew 144 MB)."""
    gc.collect()
    selfmem.trim()
    base = read_process(os.getpid()).rss_bytes
    held = [bytes(1000 + i % 7) for i in range(200_000)]   # about 200 MB of small heap blocks
    grown = read_process(os.getpid()).rss_bytes
    keep = held[::1000]   # a few survivors scattered through the heap, as in a long run
    del held
    gc.collect()
    assert selfmem.limit_arenas() is True
    selfmem.trim()
    trimmed = read_process(os.getpid()).rss_bytes
    assert grown - base > 150 << 20
    assert trimmed < grown - 100 << 20, (base >> 20, grown >> 20, trimmed >> 20)
    assert keep
