"""models.host_memory: inside ``large_blocks_mapped`` the blocks a load frees go back to the
system even where small live allocations sit between them (what glibc's moving threshold
would keep in the heap).

It runs in a fresh interpreter, as a replica's load does: glibc serves a large request from
free heap memory when it has some, and a test process that has run other tests has plenty,
so nothing would need mapping there."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json
import torch
from models.host_memory import large_blocks_mapped
def anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
mib = 2**20
torch.ones(3 * mib).sum()  # a 12 MiB block freed: glibc's threshold moves above 4 MiB
with large_blocks_mapped() as ok:
    before = anon()
    big, small = [], []
    for _ in range(24):
        big.append(torch.ones(mib))  # 4 MiB each, every page touched
        small.append(torch.ones(16))  # a live heap allocation after each
    grown = anon() - before
    big.clear()
    returned = grown - (anon() - before)
print(json.dumps({"ok": ok, "grown": grown, "returned": returned, "small": len(small)}))
"""


def test_freed_large_blocks_are_returned_with_small_ones_live_between_them() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], check=True, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert got["ok"]  # this machine's C library is glibc
    assert got["grown"] >= 80 * mib
    assert got["returned"] >= 0.9 * got["grown"], got
    assert got["small"] == 24
