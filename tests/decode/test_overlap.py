"""Overlapped scheduling (``decode.overlap``): step n + 1 planned and launched before step n is
read, its plain decodes fed step n's tokens on the device. Forced on here on the CPU (a GPU
turns it on): every request gets the tokens and the ending it gets with each step read
before the next is planned, blocks all come back, and steps did overlap."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.logprobs import TokenLogprob
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from tests.decode.engine_utils import make_request

Served = dict[int, tuple[list[int], str | None]]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + 6 * i,), generator=g).tolist() for i in range(n)]


def _serve(
    engine: DecodeEngine,
    reqs: list[Request],
    abort: int | None,
    logprobs: dict[int, list[TokenLogprob]] | None = None,
) -> Served:
    """Requests arrive one a step while the others decode; ``abort`` (an index) is aborted
    once it has three tokens. Returns each one's tokens and finish reason, by index (and
    gathers the logprobs reported into ``logprobs``)."""
    got: Served = {i: ([], None) for i in range(len(reqs))}
    index = {r.request_id: i for i, r in enumerate(reqs)}
    arriving = list(reqs)
    done: set[int] = set()
    deadline = time.monotonic() + 120
    while len(done) < len(reqs) and time.monotonic() < deadline:
        if arriving:
            engine.add(arriving.pop(0), None)
        for o in engine.step():
            assert o.error is None, o.error
            i = index[o.request_id]
            if logprobs is not None:
                logprobs.setdefault(i, []).extend(o.logprobs)
            tokens = got[i][0] + list(o.new_token_ids)
            got[i] = (tokens, o.finish_reason)
            if o.finished:
                done.add(i)
            elif i == abort and len(tokens) >= 3:
                engine.abort(o.request_id)
                got[i] = (tokens, "aborted")
                done.add(i)
    while engine.has_work and time.monotonic() < deadline:
        assert not engine.step()  # what was in the air when the last ones ended: dropped
    assert len(done) == len(reqs), "the engine did not finish every request"
    assert engine.allocator.num_free == engine.cfg.num_blocks
    return got


def _params(kind: str, stop: int | None, longer: int) -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=9)
    out = [
        SamplingParams(temperature=0.0, max_tokens=11, stop_token_ids=(stop,) if stop else ()),
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, seed=5, seeded=True),
        replace(greedy, max_tokens=12),
        SamplingParams(temperature=0.7, max_tokens=1, seed=6, seeded=True),
        replace(greedy, max_tokens=2),
        SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=7, seeded=True),
    ]
    if kind == "mixed":  # logprobs go on unread (staged with the token); a penalty does not
        out[2] = replace(out[2], logprobs=2)
        out[3] = replace(out[3], logprobs=0)
        out[4] = replace(out[4], max_tokens=7, presence_penalty=0.5)
    return [replace(sp, max_tokens=sp.max_tokens * longer) for sp in out]


@pytest.mark.parametrize(
    ("kind", "num_blocks", "longer", "shapes"),
    [
        ("plain", 128, 1, "ragged"),
        ("plain", 128, 1, "bucketed"),
        ("mixed", 128, 1, "ragged"),
        ("plain", 10, 3, "ragged"),
    ],
)
def test_overlapped_steps_serve_what_steps_read_one_by_one_serve(
    tiny_folder: Path, kind: str, num_blocks: int, longer: int, shapes: str
) -> None:
    """Greedy and seeded sampled requests, a stop token met mid-way, one-token and short
    requests, an abort while a step is in the air, ragged and bucketed steps; ``mixed`` adds
    logprobs and a penalty (steps read at once); 10 blocks, longer outputs and chunked
    prompts make requests preempt (planning beside a step then waits for its read)."""
    target = ModelSpec(str(tiny_folder))
    prompts = _prompts(6, 20, seed=11)
    base = DecodeEngineConfig(
        "t",
        target,
        DraftSpec(),
        num_blocks=num_blocks,
        max_num_batched_tokens=24 * longer,
        step_shapes=shapes,  # bucketed: the next step's tokens put in its bucket on the device
    )
    probe = DecodeEngine(replace(base, overlap="off"))
    first = _serve(
        probe,
        [make_request(p, sp) for p, sp in zip(prompts, _params(kind, None, longer), strict=True)],
        None,
    )
    stop = first[0][0][4]  # request 0 then stops at its fifth token (or before, if it repeats)
    served: dict[str, Served] = {}
    stats = {}
    logprobs: dict[str, dict[int, list[TokenLogprob]]] = {}
    for overlap in ("off", "on"):
        engine = DecodeEngine(replace(base, overlap=overlap))
        assert engine.overlap is (overlap == "on")
        reqs = [
            make_request(p, sp) for p, sp in zip(prompts, _params(kind, stop, longer), strict=True)
        ]
        logprobs[overlap] = {}
        served[overlap] = _serve(engine, reqs, abort=5, logprobs=logprobs[overlap])
        stats[overlap] = engine.stats()
        if shapes == "bucketed":
            assert engine.bucketed is not None and engine.bucketed.bucketed_steps > 0
        engine.close()
    assert served["on"] == served["off"]
    assert served["on"][0][1] == "stop" and served["on"][5][1] == "aborted"
    assert logprobs["on"] == logprobs["off"]  # the same values, staged with the token or not
    if kind == "mixed":
        tokens, lps = served["on"][2][0], logprobs["on"][2]
        assert [lp.token for lp in lps] == tokens and all(len(lp.top) == 2 for lp in lps)
        assert len(logprobs["on"][3]) == 1 and logprobs["on"][3][0].top == ()
    assert stats["off"].steps_overlapped == 0
    assert stats["on"].steps_overlapped > (10 if kind == "plain" else 0)
    if num_blocks == 10:
        assert stats["on"].preemptions > 0
    else:  # a step in the air is wasted only on what its read ends unforeseen: a stop, an abort
        wasted = stats["on"].target_tokens_fed - stats["off"].target_tokens_fed
        assert 0 <= wasted <= 2


def test_a_drafter_or_ngram_engine_reads_each_step_before_the_next(tiny_folder: Path) -> None:
    """Drafting needs the last tokens on the host: overlap on is refused by name (logged) and
    the steps run as they do with it off."""
    spec = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=3, adaptive=False)
    engine = DecodeEngine(DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), spec, overlap="on"))
    assert not engine.overlap
    reqs = [
        make_request(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in _prompts(2, 20, 3)
    ]
    got = _serve(engine, reqs, None)
    assert all(len(t) == 6 for t, _ in got.values())
    assert engine.stats().steps_overlapped == 0


@pytest.mark.parametrize("where", ["launch", "read"])
def test_a_step_that_fails_beside_another_fails_both_as_one_batch(
    tiny_folder: Path, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that raises while another is in the air (its launch, or its read once the next
    was planned on it): both steps' requests are bisected as one failed batch, their
    placeholders dropped, and every request still gets the tokens it gets with no fault."""
    import decode.spec_step

    target = ModelSpec(str(tiny_folder))
    prompts = _prompts(4, 20, seed=13)
    sp = [
        SamplingParams(temperature=0.0, max_tokens=10),
        SamplingParams(temperature=0.8, max_tokens=10, seed=3, seeded=True),
    ]
    cfg = DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64, overlap="on")
    want = _serve(
        DecodeEngine(cfg), [make_request(p, sp[i % 2]) for i, p in enumerate(prompts)], None
    )
    engine = DecodeEngine(cfg)
    calls = {"n": 0}
    real: Any = engine.target.run if where == "launch" else decode.spec_step._read_once
    in_air = []

    def faulty(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 8:  # steady decoding by then
            in_air.append(engine._flight)
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    if where == "launch":
        monkeypatch.setattr(engine.target, "run", faulty)
    else:
        monkeypatch.setattr(decode.spec_step, "_read_once", faulty)
    got = _serve(engine, [make_request(p, sp[i % 2]) for i, p in enumerate(prompts)], None)
    assert got == want
    assert in_air[0] is not None and in_air[0].ahead  # another step was in the air
    stats = engine.stats()
    assert stats.step_failures == 1 and stats.steps_overlapped > 0
    assert not engine.suspects
