"""Host memory that a weight load frees goes back to the operating system.

glibc's ``malloc`` serves a large request (128 KiB at first) with its own ``mmap``, which
``free`` unmaps, but it raises that threshold to the size of every such block freed (up to
32 MiB), so after the first full-precision weight is freed the next ones, and every
temporary of that size, come from the heap, whose freed middle is never returned. A load that
quantizes layer by layer (``LlamaModel.load_weights(quant=...)``) frees a full-precision
layer after each one: under the moving threshold the process keeps those pages, and the load
peaks above quantizing the whole model at the end. ``large_blocks_mapped`` fixes the
threshold while a load runs, then leaves it at glibc's own ceiling, the value the moving
threshold reaches once a weight is freed, so the steps that follow allocate as they would
have. The threshold decides only what the heap's free memory cannot serve: it matters to a
replica loading at start-up, whose heap is small, as here.

Serving frees memory too: a prefill forward's temporaries are sized by its token count, new
nearly every time, and glibc's arenas keep what they free for reuse, so a replica's resident
memory climbs toward the sum of every size it has seen. ``release_free_heap`` gives the free
pages of every arena back (``malloc_trim``); a replica calls it when it goes idle. Nothing is
done where the C library is not glibc (``mallopt``, ``malloc_trim`` missing).

Large, long-lived buffers that are read all over (the KV pool) live in a mapping of their own
that asks for transparent huge pages before any page of it is touched (``huge_page_mapping``):
where the kernel hands them out only on request (``transparent_hugepage/enabled`` set to
``madvise``, a common default), a pool on 4 KiB pages costs a page walk for nearly every block
attention reads, and a block-major pool (``models.kv_layout``) spreads one layer's blocks over
the most pages. A mapping of its own, not ``malloc``: a process that has freed memory before
serves a large request from pages it already holds, 4 KiB ones, and advice cannot change a
page already there. Where huge pages are off, the advice changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_LOAD_THRESHOLD = 128 * 1024  # glibc's initial threshold: every weight and temporary mapped
_SERVING_THRESHOLD = 32 * 1024 * 1024  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
HUGE_PAGE = 2 * 1024 * 1024  # x86-64 and arm64 (4 KiB granule) transparent huge pages


def _libc_fn(name: str) -> Callable[..., int] | None:
    lib = ctypes.util.find_library("c")
    if lib is None:
        return None
    fn: Callable[..., int] | None = getattr(ctypes.CDLL(lib), name, None)
    return fn


def _proc_bytes(path: str, key: str) -> int:
    """A ``key: N kB`` line of a Linux /proc file, in bytes (0 where it has none)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def anon_bytes() -> int:
    """This process's resident anonymous memory (Linux ``RssAnon``)."""
    return _proc_bytes("/proc/self/status", "RssAnon")


def anon_huge_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (Linux ``AnonHugePages``)."""
    return _proc_bytes("/proc/self/smaps_rollup", "AnonHugePages")


def onednn_cache_capacity() -> int | None:
    """The matmul shapes this process's oneDNN caches hold, as its environment set them
    (``PoolConfig.onednn_cache_capacity``; None: the libraries' default)."""
    value = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    return int(value) if value else None


def release_free_heap() -> int | None:
    """Return the free memory of every malloc arena to the system; the resident anonymous
    bytes that went back (None where the C library has no ``malloc_trim``)."""
    fn = _libc_fn("malloc_trim")
    if fn is None:
        return None
    before = anon_bytes()
    fn(0)
    return max(0, before - anon_bytes())


@contextmanager
def large_blocks_mapped() -> Iterator[bool]:
    """While inside, every allocation of 128 KiB or more is its own mapping, so freeing it
    returns it to the system; yields whether the C library allows it (glibc)."""
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
    """A fresh anonymous mapping of ``nbytes`` (zero-filled, nothing touched yet) that asks for
    transparent huge pages (``MADV_HUGEPAGE``) where the platform has the advice; where it has
    not, or refuses it, a plain mapping (logged)."""
    # private: an anonymous shared mapping is shmem, whose huge pages follow another setting
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        log.info("no MADV_HUGEPAGE here: a %d-byte mapping stays on ordinary pages", nbytes)
        return buf
    try:
        buf.madvise(advice)
    except OSError as e:  # e.g. a kernel built without transparent huge pages
        log.info("MADV_HUGEPAGE refused (%s): a %d-byte mapping stays on ordinary pages", e, nbytes)
    return buf
