"""Tensor parallelism on a real Ray cluster: TP=2 decode and TP=2 prefill → TP=2 decode give
exactly the TP=1 outputs, with every rank's KV heads moved over its own NIXL agent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.loop import EngineLoop
from decode.outputs import StepOutput
from kvtransfer.tp_transport import RANK_CALL_TIMEOUT_S, GroupTransport
from models.eagle import save_random_eagle
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from tests.decode.engine_utils import make_request, run_all
from tests.helpers import wait_until

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
    g = torch.Generator().manual_seed(31)
    return [torch.randint(3, 49152, (20 + 9 * i,), generator=g).tolist() for i in range(3)]


def _run(engine: DecodeEngine, prefill: PrefillWorker | None) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_tokens=16)] * 2 + [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=5, seeded=True)
    ]
    reqs = [make_request(p, sp) for p, sp in zip(_prompts(), params, strict=True)]
    out = run_all(engine, reqs, prefill=prefill)
    return [out[r.request_id] for r in reqs]


KW = {"num_blocks": 64, "num_threads": 1}
WEDGE_S = 8.0  # how long a rank stays silent


@pytest.fixture(scope="module")
def tp1(specs: tuple[ModelSpec, DraftSpec]) -> tuple[DecodeEngine, PrefillWorker]:
    """A TP=1 decode engine and prefill worker: the references, and one side of the
    heterogeneous handoffs."""
    target, draft = specs
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, **KW))  # type: ignore[arg-type]
    return engine, PrefillWorker(PrefillWorkerConfig("t", target, draft, **KW))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def want(tp1: tuple[DecodeEngine, PrefillWorker]) -> tuple[list[list[int]], list[list[int]]]:
    """TP=1 outputs: the engine computing prompts itself, and prompts handed off by prefill."""
    engine, prefill = tp1
    return _run(engine, None), _run(engine, prefill)


@pytest.fixture(scope="module")
def tp2(specs: tuple[ModelSpec, DraftSpec]) -> Iterator[tuple[DecodeEngine, PrefillWorker]]:
    """A TP=2 decode engine and a TP=2 prefill worker, each rank with its own NIXL agent."""
    target, draft = specs
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, tp_size=2, **KW))  # type: ignore[arg-type]
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, draft, tp_size=2, **KW))  # type: ignore[arg-type]
    yield engine, prefill
    prefill.close()
    engine.close()


def _leases_end(prefill: PrefillWorker) -> None:
    deadline = time.monotonic() + 10  # completion notices arrive asynchronously from each rank
    while prefill.stats().active_leases and time.monotonic() < deadline:
        prefill.reap()
        time.sleep(0.05)
    assert prefill.stats().active_leases == 0  # released only once every reader reported


def test_tp2_decode_and_tp2_to_tp2_handoff_match_tp1(
    want: tuple[list[list[int]], list[list[int]]], tp2: tuple[DecodeEngine, PrefillWorker]
) -> None:
    want_local, want_disagg = want
    tp_engine, tp_prefill = tp2
    assert _run(tp_engine, None) == want_local

    assert len(tp_prefill.transport.sources()) == 2  # each rank's agent is in the handoff
    before = tp_engine.transport.counters.bytes_pulled
    assert _run(tp_engine, tp_prefill) == want_disagg
    # Every rank read its own heads: the target's blocks in full (both halves) plus the draft's.
    pool = tp_engine.pool.spec
    per_block = sum(g.block_bytes(pool.block_size) for g in pool.groups)
    half_target = pool.group("target").block_bytes(pool.block_size)
    blocks = sum((len(p) + 15) // 16 for p in _prompts())
    assert tp_engine.transport.counters.bytes_pulled - before == blocks * (per_block + half_target)
    _leases_end(tp_prefill)
    assert tp_engine.allocator.num_free == 64


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_rank_that_cannot_post_leaves_no_read_running_and_no_pull_held(
    tp2: tuple[DecodeEngine, PrefillWorker], bad_rank: int
) -> None:
    """One decode rank cannot post its read (its source's agent metadata is unusable) while
    the other rank's read runs: rank 0 failing after rank 1 posted, or rank 1 failing beside
    rank 0. The pull fails, its blocks wait until every rank's read has ended, the prompt is
    recomputed (the output of an unbroken handoff), and no rank holds a pull afterwards."""
    engine, prefill = tp2
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    first = make_request(_prompts()[1], sp)
    want = run_all(engine, [first], prefill=prefill)[first.request_id]
    before = engine.stats().kv_recomputed
    r = make_request(_prompts()[1], sp)
    h = prefill.prefill(r)
    ghost = replace(h.sources[bad_rank], agent_name="ghost", metadata=b"not an agent")
    h = replace(h, sources=tuple(ghost if i == bad_rank else s for i, s in enumerate(h.sources)))
    out = [h.first_token]
    engine.add(r, h)
    deadline = time.monotonic() + 60
    while engine.has_work and time.monotonic() < deadline:
        for o in engine.step():
            assert o.error is None, o.error
            out.extend(o.new_token_ids)
    assert out == want
    assert engine.stats().kv_recomputed == before + 1
    assert engine.allocator.num_free == 64 and not engine.intake.quarantine
    assert engine.transport.outstanding() == 0  # rank 1 holds no pull
    prefill.reap(
        now=time.monotonic() + h.lease_seconds + prefill.cfg.lease_grace_s + 1
    )  # the ghost rank never read it
    assert prefill.stats().active_leases == 0 and prefill.stats().free_blocks == 64


@pytest.mark.parametrize(("p", "d"), [(1, 2), (2, 1)])
def test_heterogeneous_tp_handoff_matches_tp1(
    want: tuple[list[list[int]], list[list[int]]],
    tp1: tuple[DecodeEngine, PrefillWorker],
    tp2: tuple[DecodeEngine, PrefillWorker],
    p: int,
    d: int,
) -> None:
    """Prefill TP != decode TP: each decode rank reads exactly its heads from whichever prefill
    ranks hold them, and the outputs are the TP=1 ones."""
    engine = (tp1 if d == 1 else tp2)[0]
    prefill = (tp1 if p == 1 else tp2)[1]
    before = engine.transport.counters.bytes_pulled
    assert _run(engine, prefill) == want[1]
    # Every byte of every group arrived exactly once over all decode ranks.
    pool = prefill.pool.spec
    per_block = sum(g.block_bytes(pool.block_size) for g in pool.groups)
    if p == 2:  # rank 0's pool holds half the target's heads; rank 1 holds the other half
        per_block += pool.group("target").block_bytes(pool.block_size)
    blocks = sum((len(x) + 15) // 16 for x in _prompts())
    assert engine.transport.counters.bytes_pulled - before == blocks * per_block
    _leases_end(prefill)


def test_tp2_draft_trees_match_tp1(
    tiny_folder: Path, tmp_path: Path, want: tuple[list[list[int]], list[list[int]]]
) -> None:
    """Greedy requests verifying EAGLE draft trees over TP=2: each rank attends over its heads
    with the tree's mask and applies the accepted path's KV moves; the outputs are TP=1's
    (greedy: the target's, whatever drafted them)."""
    head = save_random_eagle(tiny_folder, tmp_path / "eagle")
    target = ModelSpec(str(tiny_folder))
    draft = DraftSpec(
        DraftKind.EAGLE, ModelSpec(str(head)), 3, adaptive=False, lookup_first=True, tree_width=3
    )
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, tp_size=2, **KW))  # type: ignore[arg-type]
    assert _run(engine, None)[:2] == want[0][:2]  # the greedy ones; the sampled one by chain
    engine.close()


def test_an_int8_tp2_engine_starts_and_decodes_what_int8_tp1_does(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    """int8 weights over two ranks: each rank's load quantizes with row maxima all-reduced over
    the group, so rank 0 must load beside the actors, not after them (before, each side waited
    on the other until gloo's timeout). The TP = 2 engine starts in seconds and its greedy
    tokens are TP = 1's."""
    target, _ = specs
    int8 = replace(target, quantization="int8")
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    outs = []
    for tp in (1, 2):
        t0 = time.monotonic()
        engine = DecodeEngine(DecodeEngineConfig("t", int8, DraftSpec(), tp_size=tp, **KW))  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 120  # gloo's collectives time out at 300 s
        reqs = [make_request(p, sp) for p in _prompts()]
        got = run_all(engine, reqs)
        outs.append([got[r.request_id] for r in reqs])
        engine.close()
    assert outs[0] == outs[1]


def test_tp2_takes_a_chains_drafts_from_rank_0s_device(specs: tuple[ModelSpec, DraftSpec]) -> None:
    """A draft model's chain stays on rank 0's device and reaches rank 1 over the group's
    collectives: with the target as its own draft every greedy draft is accepted, which a
    rank fed anything else than the drafts (its host placeholders) would break."""
    target, _ = specs
    draft = DraftSpec(DraftKind.DRAFT_MODEL, model=target, num_speculative_tokens=3, adaptive=False)
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, tp_size=2, **KW))  # type: ignore[arg-type]
    sp = SamplingParams(temperature=0.0, max_tokens=13)
    reqs = [make_request(p, sp) for p in _prompts()]
    run_all(engine, reqs)
    engine.close()
    for r in reqs:
        assert r.stats.num_draft_tokens == r.stats.num_accepted_tokens == 12


def test_tp2_overlapped_plain_decoding_matches_tp1(specs: tuple[ModelSpec, DraftSpec]) -> None:
    """``decode.overlap`` over TP = 2 with bucketed steps (a GPU's): step n + 1 is launched
    before step n is read, and the tokens step n sampled reach rank 1 over the group's
    collectives, not from the host, into each rank's bucket; greedy and seeded sampled
    requests get TP = 1's tokens (ragged, read step by step)."""
    target, _ = specs
    outs, overlapped = [], []
    for tp, overlap, shapes in ((1, "off", "ragged"), (2, "on", "bucketed")):
        cfg = DecodeEngineConfig(
            "t",
            target,
            DraftSpec(),
            tp_size=tp,
            overlap=overlap,
            step_shapes=shapes,
            **KW,  # type: ignore[arg-type]
        )
        engine = DecodeEngine(cfg)
        outs.append(_run(engine, None))
        overlapped.append(engine.stats().steps_overlapped)
        if tp == 2:
            assert engine.bucketed is not None and engine.bucketed.bucketed_steps > 10
        engine.close()
    assert outs[0] == outs[1]
    assert overlapped[0] == 0 and overlapped[1] > 10


def test_a_silent_rank_wedges_the_replica_and_ends_its_requests(
    tp2: tuple[DecodeEngine, PrefillWorker],
) -> None:
    """Decode rank 1 stops answering (its actor busy, as in a stuck NIXL call): the engine
    thread's next call to it times out, the loop marks the replica wedged (its health check
    then fails and Serve replaces it), the request it held ends with an error naming the call,
    and a request arriving afterwards is refused at once instead of reusing blocks a late read
    may land in. (Last in the module: the engine stays wedged.)"""
    engine, prefill = tp2
    assert isinstance(engine.transport, GroupTransport)
    engine.transport.call_timeout_s = 1.0
    outputs: list[StepOutput] = []
    loop = EngineLoop(lambda: engine, outputs.append)
    busy = engine.transport.actors[0].__ray_call__.remote(lambda _: time.sleep(WEDGE_S))
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    held, later = make_request(_prompts()[0], sp), make_request(_prompts()[1], sp)
    assert loop.start() is engine
    t0 = time.monotonic()
    try:
        loop.submit(held, prefill.prefill(held))
        wait_until(lambda: loop.wedged is not None, WEDGE_S / 2, "the replica marked wedged")
        assert "start_pull within 1 s" in str(loop.wedged)
        assert time.monotonic() - t0 < WEDGE_S / 2  # by the call's timeout, not the rank's sleep
        loop.submit(later, None)
        wait_until(lambda: len(outputs) == 2, 10, "both requests answered")
    finally:
        loop.stop()
        engine.transport.call_timeout_s = RANK_CALL_TIMEOUT_S
    assert [o.request_id for o in outputs] == [held.request_id, later.request_id]
    assert all(o.finish_reason == "error" and o.new_token_ids == () for o in outputs)
    assert "did not answer start_pull" in str(outputs[0].error)
    assert "decode replica is wedged" in str(outputs[1].error)
    assert not engine.has_work
    ray.get(busy)  # the rank answers again; its late read found no pull to serve it
