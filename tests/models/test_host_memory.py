"""models.host_memory: inside ``large_blocks_mapped`` the blocks a load frees go back to the
system even where small live allocations sit between them (what glibc's moving threshold
would keep in the heap), and the threshold is left where serving expects it."""

from __future__ import annotations

import torch

from models.host_memory import large_blocks_mapped


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_freed_large_blocks_are_returned_with_small_ones_live_between_them() -> None:
    mib = 2**20
    torch.ones(3 * mib).sum()  # a 12 MiB block freed: glibc's threshold moves above 4 MiB
    with large_blocks_mapped() as ok:
        assert ok  # this machine's C library is glibc
        before = _anon()
        big, small = [], []
        for _ in range(24):
            big.append(torch.ones(mib))  # 4 MiB each, every page touched
            small.append(torch.ones(16))  # a live heap allocation after each
        grown = _anon() - before
        big.clear()
        returned = grown - (_anon() - before)
    assert grown >= 80 * mib
    assert returned >= 0.9 * grown, (grown, returned)
    assert len(small) == 24
