"""Giving host memory back to the OS. glibc raises its mmap threshold to each large block freed,
so a load that quantizes layer by layer would keep every freed layer in the heap
(``large_blocks_mapped`` pins it low while loading); ``release_free_heap`` trims the arenas of an
idle replica; ``huge_page_mapping`` asks for huge pages before any page is touched (the KV pool)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3
_LOAD_THRESHOLD = 128 * 1024  # glibc's initial threshold: every weight and temporary mapped
_SERVING_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
HUGE_PAGE = 2 * 1024 * 1024


def _libc_fn(name: str) -> Callable[..., int] | None:
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    fn: Callable[..., int] | None = getattr(ctypes.CDLL(lib), name, None)
    return fn


def _proc_bytes(path: str, key: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def anon_bytes() -> int:
    return _proc_bytes("/proc/self/status", "RssAnon")


def anon_huge_bytes() -> int:
    return _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages")


def onednn_cache_capacity() -> int | None:
    value = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    return int(value) if value else None


def release_free_heap() -> int | None:
    """The resident bytes returned (None where the C library has no ``malloc_trim``)."""
    fn = _libc_fn("malloc_trim")
    if fn is None:
        return None
    before = anon_bytes()
    fn(0)
    return max(0, before - anon_bytes())


@contextmanager
def large_blocks_mapped() -> Iterator[bool]:
    """Allocations of 128 KiB or more mapped while inside; yields whether glibc allowed it."""
    fn = _libc_fn("mallopt")
    ok = bool(fn is not None and fn(_M_MMAP_THRESHOLD, _LOAD_THRESHOLD))
    if not ok:
        log.debug("mallopt unavailable: freed weight memory may stay with the process")
    try:
        yield ok
    finally:
        if ok and fn is not None:
            fn(_M_MMAP_THRESHOLD, _SERVING_THRESHOLD)


def huge_page_mapping(nbytes: int) -> mmap.mmap:
    # private: an anonymous shared mapping is shmem, whose huge pages follow another setting
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        log.info("no MADV_HUGEPAGE here: a %d-byte mapping stays on ordinary pages", nbytes)
        return buf
    try:
        buf.madvise(advice)
    except OSError as e:
        log.info("MADV_HUGEPAGE refused (%s): a %d-byte mapping stays on ordinary pages", e, nbytes)
    return buf
