"""The harness's own memory over a long run (issue 27: a 10-hour soak must not grow its RSS).

What the harness holds is bounded (records and events stream to disk; rings and tails elsewhere),
but glibc's allocator keeps what Python frees in per-thread arenas: a soak starts a thread per fault,
every new thread may get an arena of its own (up to 8 per core), and a long run's RSS then climbs
with memory nobody uses (measured: a 15-minute soak's harness 307 -> 416 MB while tracemalloc saw
the Python heap flat within 1 MB). So the harness caps the arenas at :data:`ARENAS` when it starts
(``mallopt(M_ARENA_MAX)``, as ``MALLOC_ARENA_MAX`` would) and the leak sampler hands free pages back
(``malloc_trim(0)``) before it reads the harness's RSS: what stays resident is what the harness holds.
Python's own live block count (``sys.getallocatedblocks``) is sampled beside it, so a real leak of
Python objects shows even where RSS would hide it. Without glibc (musl, macOS) both are no-ops."""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)

ARENAS = 2
_M_ARENA_MAX = -8   # glibc malloc.h


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018 -- glibc only
        libc.malloc_trim  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas for threads started from now on; False without glibc."""
    if _LIBC is None:
        return False
    ok = bool(_LIBC.mallopt(_M_ARENA_MAX, arenas))
    if not ok:
        log.debug("mallopt(M_ARENA_MAX, %d) refused", arenas)
    return ok


def trim() -> bool:
    """Give the allocator's free pages back to the system; True when some were released."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def python_blocks() -> int:
    """Memory blocks Python has allocated and not freed (every live object's storage)."""
    return sys.getallocatedblocks()


__all__ = ["ARENAS", "limit_arenas", "python_blocks", "trim"]
