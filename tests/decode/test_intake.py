"""Pulls that end without landing: blocks a read may still land in stay quarantined until NIXL
says it ended, and for a bounded time only: then they are retired (never reused), counted."""

from __future__ import annotations

import time

from decode.intake import KVIntake
from kvtransfer.handoff import KVCompat, KVHandoff
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec
from models.request import Request
from models.sampling import SamplingParams

SPEC = KVPoolSpec(16, 16, (KVGroupSpec("target", 2, 2, 8, "float32"),))
COMPAT = KVCompat("m", "float32", 16, "layout", 1, "none", "nixl")


def test_a_read_that_never_ends_is_retired_after_the_quarantine_bound() -> None:
    a, b = KVPool(SPEC), KVPool(SPEC)  # held: a transport does not keep its pool alive
    src, dst = NixlTransport(a, "prefill"), NixlTransport(b, "decode")
    intake = KVIntake(dst, margin_s=0.0, quarantine_s=0.2)
    req = Request("r1", list(range(20)), SamplingParams())
    req.block_table = [4, 5]
    handoff = KVHandoff("r1", src.sources(), (1, 2), ("target",), 20, 7, COMPAT, 30.0)
    assert intake.start(req, handoff, lease_end=time.monotonic() + 30) is None
    assert intake.cancel("r1")  # the source makes no progress: the read cannot end
    assert intake.quarantined_blocks == 2 and req.block_table == []
    cancelled, freed = intake.settled()
    assert [r.request_id for r in cancelled] == ["r1"] and freed == []
    time.sleep(0.3)
    assert intake.settled() == ([], [])  # not freed: retired
    assert intake.quarantined_blocks == 0 and intake.retired_blocks == 2
