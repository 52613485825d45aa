"""Continuous batching: chunked local prompts, joins mid-flight, preemption that changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from tests.decode.engine_utils import make_request, run_all


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + 5 * i,), generator=g).tolist() for i in range(n)]


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=11, seeded=True)
    return [greedy, seeded] * 3


def _outputs(engine: DecodeEngine, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [make_request(p, sp) for p, sp in zip(prompts, _params(), strict=False)]
    out = run_all(engine, reqs)
    return [out[r.request_id] for r in reqs]


@pytest.fixture(scope="module")
def specs(tiny_folder: Path, tiny_draft_folder: Path) -> tuple[ModelSpec, DraftSpec]:
    draft = DraftSpec(
        DraftKind.DRAFT_MODEL, model=ModelSpec(str(tiny_draft_folder)), num_speculative_tokens=3
    )
    return ModelSpec(str(tiny_folder)), draft


@pytest.mark.slow
def test_preemption_and_chunking_do_not_change_outputs(specs: tuple[ModelSpec, DraftSpec]) -> None:
    target, draft = specs
    prompts = _prompts(6, 30, seed=21)
    roomy = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=256))
    want = _outputs(roomy, prompts)
    # 6 requests of ~45-110 tokens each need ~40 blocks of 16 at the end; give them 14, and
    # a step budget small enough to chunk every prompt.
    tight = DecodeEngine(
        DecodeEngineConfig("t", target, draft, num_blocks=14, max_num_batched_tokens=24)
    )
    got = _outputs(tight, prompts)
    assert got == want
    assert tight.stats().preemptions > 0
    assert tight.allocator.num_free == 14
    tight.allocator.check()


def test_requests_join_and_leave_every_step(specs: tuple[ModelSpec, DraftSpec]) -> None:
    target, _ = specs
    engine = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=128))
    prompts = _prompts(3, 12, seed=22)
    short = make_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=3))
    long = make_request(prompts[1], SamplingParams(temperature=0.0, max_tokens=12))
    late = make_request(prompts[2], SamplingParams(temperature=0.0, max_tokens=4))
    engine.add(short, None)
    engine.add(long, None)
    seen_running: list[int] = []
    finished: dict[str, int] = {}
    for step in range(40):
        if step == 4:
            engine.add(late, None)
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = step
        seen_running.append(len(engine.running))
        if len(finished) == 3:
            break
    assert finished[short.request_id] < finished[late.request_id] < finished[long.request_id]
    assert 2 in seen_running and 1 in seen_running  # the batch grew and shrank mid-flight
    assert engine.allocator.num_free == 128


def test_batch_of_sixteen_matches_one_at_a_time(specs: tuple[ModelSpec, DraftSpec]) -> None:
    target, draft = specs
    prompts = _prompts(16, 10, seed=23)
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=512))
    params = SamplingParams(temperature=0.0, max_tokens=12)
    together = [make_request(p, params) for p in prompts]
    out = run_all(engine, together)
    for p, r in zip(prompts, together, strict=True):
        alone = make_request(p, params)
        assert run_all(engine, [alone])[alone.request_id] == out[r.request_id]


def test_request_larger_than_the_pool_fails_cleanly(specs: tuple[ModelSpec, DraftSpec]) -> None:
    target, _ = specs
    engine = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=4))
    req = Request("big", list(range(3, 200)), SamplingParams(temperature=0.0, max_tokens=4))
    engine.add(req, None)
    outs = engine.step()
    assert outs[0].finish_reason == "error" and "at most 64" in (outs[0].error or "")
    assert engine.allocator.num_free == 4


def test_prompt_plus_max_tokens_beyond_the_pool_is_refused_and_the_queue_moves(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    """A prompt that fits whose growth never can is refused at admission, naming the pool's
    capacity and the setting that sizes it; the request behind it is served as if alone."""
    target, _ = specs
    engine = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=4))
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    alone = run_all(engine, [r := make_request(list(range(3, 23)), sp)])[r.request_id]
    big = make_request(list(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=100))
    behind = make_request(list(range(3, 23)), sp)
    engine.add(big, None)
    engine.add(behind, None)
    outs = {o.request_id: o for o in engine.step()}
    err = outs[big.request_id].error or ""
    assert outs[big.request_id].finish_reason == "error"
    assert "121 tokens" in err and "at most 64" in err and "decode.num_blocks" in err
    first = outs[behind.request_id]  # admitted in the same step, unharmed
    assert first.error is None
    out: list[int] = list(first.new_token_ids)
    while engine.has_work:
        out += [
            t for o in engine.step() if o.request_id == behind.request_id for t in o.new_token_ids
        ]
    assert out == alone and engine.allocator.num_free == 4


def _crowd() -> list[Request]:
    """Three requests in a 10-block pool where the newest is preempted, re-admitted when the
    short one ends, and preempted again before it can produce a token."""
    g = SamplingParams
    return [
        Request("A", list(range(3, 19)), g(temperature=0.0, max_tokens=120)),
        Request("C", list(range(5, 21)), g(temperature=0.0, max_tokens=40)),
        Request("B", list(range(3, 73)), g(temperature=0.0, max_tokens=82)),
    ]


def _solo(target: ModelSpec, r: Request) -> list[int]:
    engine = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=16))
    one = Request(r.request_id, list(r.prompt_token_ids), r.sampling)
    return run_all(engine, [one])[r.request_id]


@pytest.mark.slow
@pytest.mark.parametrize("limit", [1, 4])
def test_a_request_that_cannot_progress_never_stalls_the_others(
    specs: tuple[ModelSpec, DraftSpec], limit: int
) -> None:
    """Preempted before its first token: with ``max_stalled_preemptions`` 1 it ends with an
    error at once; with 4, preempted again after being re-admitted, it waits until it has room to
    finish, and finishes. Either way every other request's output is its output alone and every
    block comes back."""
    target, _ = specs
    cfg = DecodeEngineConfig(
        "t",
        target,
        DraftSpec(),
        num_blocks=10,
        max_num_batched_tokens=4,
        max_stalled_preemptions=limit,
    )
    engine = DecodeEngine(cfg)
    reqs = _crowd()
    errors: dict[str, str | None] = {}
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add(r, None)
    for _ in range(5000):
        if not engine.has_work:
            break
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finished:
                errors[o.request_id] = o.error
    assert engine.preemptions >= min(limit, 2) and engine.allocator.num_free == 10
    for r in reqs:
        if limit == 1 and r.request_id == "B":
            assert "1 time in a row without producing a token" in (errors["B"] or "")
            assert "decode.max_stalled_preemptions" in (errors["B"] or "")
            assert engine.stats().stalled == 1
        else:
            assert errors[r.request_id] is None and out[r.request_id] == _solo(target, r)
