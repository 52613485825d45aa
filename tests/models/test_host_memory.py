"""models.host_memory: inside ``large_blocks_mapped`` the blocks a load frees go back to the
system even where small live allocations sit between them (what glibc's moving threshold
would keep in the heap); outside it, heap blocks freed between live ones stay with the
process until ``release_free_heap``.

Each runs in a fresh interpreter, as a replica's load does: glibc serves a large request from
free heap memory when it has some, and a test process that has run other tests has plenty,
so nothing would need mapping there."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import json
import torch
from models.host_memory import anon_bytes as anon, large_blocks_mapped
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


RELEASE_CHILD = """
import json
import torch
from models.host_memory import anon_bytes, large_blocks_mapped, release_free_heap
with large_blocks_mapped():
    pass  # afterwards the serving threshold: 4 MiB blocks come from the heap
before = anon_bytes()
big, small = [], []
for _ in range(24):
    big.append(torch.ones(2**20))  # 4 MiB each, every page touched
    # a live block after each, too large for the heap's free fragments, so it sits right
    # after its big one and the heap's top cannot shrink back over the freed blocks
    small.append(torch.ones(60_000))
grown = anon_bytes() - before
big.clear()
kept = anon_bytes() - before
released = release_free_heap()
print(json.dumps({"grown": grown, "kept": kept, "released": released, "small": len(small)}))
"""


def test_heap_blocks_freed_between_live_ones_go_back_only_when_released() -> None:
    out = subprocess.run(
        [sys.executable, "-c", RELEASE_CHILD], check=True, capture_output=True, text=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["grown"] >= 80 * 2**20
    assert got["kept"] >= 0.8 * got["grown"], got  # freed, yet still resident
    assert got["released"] >= 0.8 * got["grown"], got
    assert got["small"] == 24
