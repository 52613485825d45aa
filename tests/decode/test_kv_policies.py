"""KV transfer in production shape: the object-store fallback, failure policies, no leaks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from kvtransfer.handoff import KVHandoff
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import KVPool
from kvtransfer.select import make_transport, nixl_self_check
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from tests.decode.engine_utils import make_request, run_all

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module", autouse=True)
def _ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def specs(tiny_folder: Path, tiny_draft_folder: Path) -> tuple[ModelSpec, DraftSpec]:
    draft = DraftSpec(
        DraftKind.DRAFT_MODEL, model=ModelSpec(str(tiny_draft_folder)), num_speculative_tokens=3
    )
    return ModelSpec(str(tiny_folder)), draft


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(51)
    return [torch.randint(3, 49152, (15 + 9 * i,), generator=g).tolist() for i in range(3)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _outputs(engine: DecodeEngine, prefill: PrefillWorker | None) -> list[list[int]]:
    reqs = [make_request(p, GREEDY) for p in _prompts()]
    out = run_all(engine, reqs, prefill=prefill)
    return [out[r.request_id] for r in reqs]


def test_nixl_passes_its_self_check_here_and_the_choice_is_explicit() -> None:
    from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec

    assert nixl_self_check("cpu") is None
    pool = KVPool(KVPoolSpec(4, 4, (KVGroupSpec("target", 1, 1, 8, "float32"),)))
    t, why = make_transport("auto", pool, "test")
    assert t.name == "nixl" and why is None
    t, why = make_transport("object_store", pool, "test")
    assert t.name == "object_store" and why is not None and "object_store" in why


def test_object_store_fallback_gives_the_same_outputs(specs: tuple[ModelSpec, DraftSpec]) -> None:
    target, draft = specs
    want = _outputs(DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64)), None)
    engine = DecodeEngine(
        DecodeEngineConfig("t", target, draft, num_blocks=64, transport="object_store")
    )
    prefill = PrefillWorker(
        PrefillWorkerConfig("t", target, draft, num_blocks=32, transport="object_store")
    )
    assert engine.transport.name == prefill.transport.name == "object_store"
    assert _outputs(engine, prefill) == want
    assert engine.stats().target_tokens_fed < sum(len(p) for p in _prompts())  # no recompute
    assert engine.transport.counters.pulls_done == 3 and engine.transport.counters.bytes_pulled > 0
    prefill.reap()
    assert prefill.stats().active_leases == 0 and prefill.stats().free_blocks == 32


def test_a_decode_host_clock_an_hour_ahead_still_pulls(
    specs: tuple[ModelSpec, DraftSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leases are durations, each side timing them on its own monotonic clock: a decode host
    whose wall clock runs an hour ahead of prefill's (once: every lease looked expired, every
    prompt was recomputed) pulls every handoff."""
    target, draft = specs
    want = _outputs(DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64)), None)
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64))
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, draft, num_blocks=32))
    reqs = [make_request(p, GREEDY) for p in _prompts()]
    handoffs = [prefill.prefill(r) for r in reqs]
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600.0)  # this host, from here on
    out = {r.request_id: [h.first_token] for r, h in zip(reqs, handoffs, strict=True)}
    for r, h in zip(reqs, handoffs, strict=True):
        engine.add(r, h)
    deadline = time.monotonic() + 120
    while engine.has_work and time.monotonic() < deadline:
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.new_token_ids)
    assert [out[r.request_id] for r in reqs] == want
    assert engine.stats().kv_recomputed == 0 and engine.transport.counters.pulls_done == 3


def test_sides_on_different_transports_refuse_by_name_and_recompute_nothing(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    """A NIXL prefill and an object-store decode cannot move a block: the first handoff fails
    naming both transports, instead of every pull failing and every prompt being recomputed."""
    target, draft = specs
    engine = DecodeEngine(
        DecodeEngineConfig("t", target, draft, num_blocks=64, transport="object_store")
    )
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, draft, num_blocks=32))
    assert prefill.transport.name == "nixl"
    r = make_request(_prompts()[0], GREEDY)
    engine.add(r, prefill.prefill(r))
    (out,) = engine.step()
    assert out.finished and out.error is not None
    assert "transport=object_store" in out.error and "transport=nixl" in out.error
    assert engine.stats().kv_recomputed == 0 and engine.allocator.num_free == 64
    assert engine.stats().kv_recent_failed == 1  # a failed handoff all the same (/health)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_pulls_follow_the_policy(
    specs: tuple[ModelSpec, DraftSpec], policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every failed pull follows the policy and is counted for /health; the first one is
    logged as an error, the others only counted."""
    target, draft = specs
    want = _outputs(DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64)), None)
    engine = DecodeEngine(
        DecodeEngineConfig("t", target, draft, num_blocks=64, kv_failure_policy=policy)
    )
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, draft, num_blocks=32))
    reqs = [make_request(p, GREEDY) for p in _prompts()]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    errors: dict[str, str | None] = {}
    for r in reqs:
        h = prefill.prefill(r)
        got[r.request_id].append(h.first_token)
        engine.add(
            r, replace(h, lease_seconds=0.0)
        )  # every lease already ended: reads must not start
    with caplog.at_level(logging.DEBUG, logger="decode.engine"):
        while engine.has_work:
            for o in engine.step():
                got[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    errors[o.request_id] = o.error
    loud = [r for r in caplog.records if r.name == "decode.engine" and r.levelno >= logging.ERROR]
    assert len(loud) == 1 and "counted in /health" in loud[0].getMessage()
    stats = engine.stats()
    assert stats.kv_handoffs == stats.kv_recent_handoffs == stats.kv_recent_failed == 3
    if policy == "recompute":
        assert [got[r.request_id] for r in reqs] == want  # computed here, same tokens
        assert all(e is None for e in errors.values()) and engine.stats().kv_recomputed == 3
    else:
        assert all(e is not None and "lease" in e for e in errors.values())
    assert engine.allocator.num_free == 64
    engine.allocator.check()


def test_no_block_leaks_after_completed_cancelled_and_expired_handoffs(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    target, draft = specs
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64))
    prefill = PrefillWorker(
        PrefillWorkerConfig("t", target, draft, num_blocks=32, lease_seconds=30)
    )
    done, cancelled, expired = (make_request(p, GREEDY) for p in _prompts())
    t0 = time.perf_counter()
    run_all(engine, [done], prefill=prefill)  # completed
    served_s = time.perf_counter() - t0  # a whole request: prefill, pull, decode
    h = prefill.prefill(cancelled)
    engine.add(cancelled, h)
    engine.step()
    t0 = time.perf_counter()
    engine.abort(cancelled.request_id)  # cancelled mid-pull or mid-decode
    # never waits for the read on the engine thread: a small part of serving a request here
    assert time.perf_counter() - t0 < served_s / 10
    prefill.cancel(cancelled.request_id)
    h2 = prefill.prefill(expired)
    prefill.step()
    # nobody pulled it in time, and the grace for a read started just in time passed
    prefill.reap(now=time.monotonic() + h2.lease_seconds + prefill.cfg.lease_grace_s + 1)
    for _ in range(50):
        engine.step()
        prefill.step()
    assert engine.allocator.num_free == 64 and prefill.stats().free_blocks == 32
    assert prefill.stats().active_leases == 0 and prefill.stats().leases_expired >= 1
    engine.allocator.check()
    prefill.allocator.check()


def _stalled_source(
    prefill: PrefillWorker, h: KVHandoff
) -> tuple[NixlTransport, KVPool, KVHandoff]:
    """A copy of prefill's pool behind an agent that makes progress only when the test says so
    (``completed()``): a read from it stays in flight until then, as from a stalled host."""
    pool = KVPool(prefill.pool.spec)
    for g in pool.spec.groups:
        pool.tensor(g.name).copy_(prefill.pool.tensor(g.name))
    src = NixlTransport(pool, "stalled")
    return src, pool, replace(h, sources=src.sources())


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_read_still_in_flight_lands_only_in_its_quarantined_blocks(
    specs: tuple[ModelSpec, DraftSpec], how: str
) -> None:
    """A pull ends while its read is still in flight (it timed out, or its client went away):
    NIXL cannot cancel a running read, so the blocks leave the request for the quarantine, and
    the other requests decode into other blocks (outputs: the reference). A canary is written
    into every free block; the source resumes and the late read lands: the canary is intact,
    the read's bytes are in the quarantined blocks, and once it has ended every block is free."""
    target, draft = specs
    want = _outputs(DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64)), None)
    engine = DecodeEngine(
        DecodeEngineConfig("t", target, draft, num_blocks=64, pull_timeout_s=0.05)
    )
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, draft, num_blocks=32))
    reqs = [make_request(p, GREEDY) for p in _prompts()]
    src, src_pool, h = _stalled_source(prefill, prefill.prefill(reqs[0]))
    got: dict[str, list[int]] = {r.request_id: [h.first_token] for r in reqs[:1]}
    got.update({r.request_id: [] for r in reqs[1:]})
    engine.add(reqs[0], h)
    engine.step()  # the pull starts; the source makes no progress, so its read cannot end
    if how == "cancel":
        engine.abort(reqs[0].request_id)
    time.sleep(0.1)  # past pull_timeout_s: the timeout under test, not synchronisation
    for r in reqs[1:]:
        engine.add(r, None)  # computed here, into blocks the late read cannot reach
    deadline = time.monotonic() + 120
    while (engine.running or engine.waiting) and time.monotonic() < deadline:
        for o in engine.step():
            assert o.error is None, o.error
            got[o.request_id].extend(o.new_token_ids)
    served = list(reqs[1:]) if how == "cancel" else reqs
    assert [got[r.request_id] for r in served] == (want[1:] if how == "cancel" else want)
    (q,) = engine.intake.quarantine  # the read is still in flight
    assert engine.stats().quarantined_blocks == len(q.blocks) == len(h.block_ids)
    pool = engine.pool.tensor("target")
    free = [b for b in range(64) if engine.allocator.ref_count(b) == 0]
    pool[:, free] = 7.0  # the canary
    while engine.has_work and time.monotonic() < deadline:
        src.completed()  # the source resumes: the late read lands
        engine.step()
    assert bool((pool[:, free] == 7.0).all())  # no byte landed outside the quarantine
    landed = pool[:, list(q.blocks)].view(torch.int32)  # bitwise: unused slots may hold NaNs
    assert torch.equal(landed, src_pool.tensor("target")[:, list(h.block_ids)].view(torch.int32))
    assert engine.stats().quarantined_blocks == 0 and engine.allocator.num_free == 64
    engine.allocator.check()
    assert not engine.intake.pending and not engine.intake.quarantine
    src.close()
