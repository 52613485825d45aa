"""Leases measured end to end: a handoff the ingress held past its lease is never pulled from
blocks that prefill has since given to another prompt (a canary), and an expired lease's
blocks wait out a grace period before prefill reuses them (a read started just in time lands)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from kvtransfer.handoff import KVHandoff
from models.request import Request
from models.sampling import SamplingParams
from models.spec import ModelSpec
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from tests.decode.engine_utils import make_request, run_all
from tests.helpers import wait_until

LEASE, GRACE = 1.0, 0.5
SP = SamplingParams(temperature=0.0, max_tokens=10)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (40,), generator=g).tolist() for _ in range(2)]


def _decode(engine: DecodeEngine, pairs: list[tuple[Request, KVHandoff]]) -> dict[str, list[int]]:
    out = {r.request_id: [h.first_token] for r, h in pairs}
    for r, h in pairs:
        engine.add(r, h)
    done: set[str] = set()
    deadline = time.monotonic() + 60
    while len(done) < len(pairs) and time.monotonic() < deadline:
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.new_token_ids
            if o.finished:
                done.add(o.request_id)
    assert len(done) == len(pairs)
    return out


def test_a_handoff_held_past_its_lease_never_reads_a_canarys_kv(tiny_folder: Path) -> None:
    target = ModelSpec(str(tiny_folder))
    # three blocks: one 40-token prompt fills the pool, so the canary must take the first's
    prefill = PrefillWorker(
        PrefillWorkerConfig(
            "t",
            target,
            num_blocks=3,
            lease_seconds=LEASE,
            lease_grace_s=GRACE,
            enable_prefix_caching=False,
        )
    )
    cfg = DecodeEngineConfig("t", target, num_blocks=64, pull_margin_s=0.2)
    engine, reference = DecodeEngine(cfg), DecodeEngine(cfg)
    first_prompt, canary_prompt = _prompts(seed=21)
    delayed = make_request(first_prompt, SP)
    handoff = prefill.prefill(delayed)
    held_from = time.monotonic()

    time.sleep(LEASE + 0.05)  # the ingress holds it (the client reads its first token slowly)
    prefill.reap()
    assert prefill.stats().cooling_blocks == 3  # expired, not yet reusable
    canary = make_request(canary_prompt, SP)
    got: list[KVHandoff | BaseException] = []
    prefill.submit(canary, got.append)
    prefill.step()
    assert not got and prefill.stats().queued == 1  # waits out the grace
    wait_until(lambda: prefill.step() or got, 10, "the canary admitted after the grace")
    [canary_handoff] = got
    assert isinstance(canary_handoff, KVHandoff)
    assert set(canary_handoff.block_ids) == set(handoff.block_ids)  # the very same blocks

    forwarded = handoff.held(time.monotonic() - held_from, time.time())
    assert forwarded.lease_seconds == 0.0
    out = _decode(engine, [(delayed, forwarded), (canary, canary_handoff)])

    twins = [make_request(p, SP) for p in (first_prompt, canary_prompt)]
    want = run_all(reference, twins)
    assert out[delayed.request_id] == want[twins[0].request_id]  # recomputed, not misread
    assert out[canary.request_id] == want[twins[1].request_id]  # untouched
    assert engine.stats().kv_recomputed == 1
    # what the ingress forwarded before (the handoff as prefill made it) is refused as well:
    # the stamp carries the time since prefill issued it
    again = make_request(first_prompt, SP)
    stale = replace(handoff, request_id=again.request_id)
    assert _decode(engine, [(again, stale)])[again.request_id] == want[twins[0].request_id]
    assert engine.stats().kv_recomputed == 2
    prefill.close()


def test_the_ingress_takes_off_its_hold_and_decode_the_transit_beyond_the_clock_offset() -> None:
    from decode.lease_clock import LeaseClock
    from kvtransfer.handoff import KVCompat

    compat = KVCompat("m", "float32", 16, "l", 1, "none", "object_store")
    h = KVHandoff("r", (), (1,), ("target",), 16, 5, compat, 30.0, lease_stamped_at=1000.0)
    fwd = h.held(3.0, now=1004.0)  # the ingress held it 3 s, on its own monotonic clock
    assert (fwd.lease_seconds, fwd.lease_stamped_at) == (27.0, 1004.0)
    assert h.held(40.0, now=1004.0).lease_seconds == 0.0
    # a decode host an hour ahead: the offset is learnt from the handoffs themselves
    clock = LeaseClock()
    assert clock.transit(1004.0, 4604.0) == 0.0
    assert clock.transit(1010.0, 4610.5) == 0.5
    assert clock.transit(1020.0, 4645.0) == 25.0  # one that waited in a router's queue
    assert clock.transit(0.0, 4700.0) == 0.0  # unstamped (a colocated request)
