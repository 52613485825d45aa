"""One request whose step raises fails alone: the batch it broke is recomputed request by
request, and every other request's tokens are the ones it gets without the faulty neighbour."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftSpec, ModelSpec
from tests.decode.engine_utils import make_request, run_all


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + 5 * i,), generator=g).tolist() for i in range(n)]


def _drive(engine: DecodeEngine, reqs: list[Request]) -> dict[str, tuple[list[int], str | None]]:
    for r in reqs:
        engine.add(r, None)
    out: dict[str, tuple[list[int], str | None]] = {r.request_id: ([], None) for r in reqs}
    done: set[str] = set()
    deadline = time.monotonic() + 120
    while len(done) < len(reqs) and time.monotonic() < deadline:
        for o in engine.step():
            tokens, _ = out[o.request_id]
            out[o.request_id] = (tokens + list(o.new_token_ids), o.error)
            if o.finished:
                done.add(o.request_id)
    assert len(done) == len(reqs), "the engine did not finish every request"
    return out


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_request_that_breaks_the_step_fails_alone(tiny_folder: Path, overlap: str) -> None:
    """``top_k`` past int64 (which the API refuses) makes the batched sampler raise: before,
    the exception escaped ``step`` and the loop ended every request on the replica. The same
    with steps planned beside the one in the air."""
    target = ModelSpec(str(tiny_folder))
    cfg = DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64, overlap=overlap)
    engine, reference = DecodeEngine(cfg), DecodeEngine(cfg)
    prompts = _prompts(3, 20, seed=5)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=3, seeded=True)
    params = [greedy, seeded, greedy]
    good = [make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    bad = make_request(prompts[0], SamplingParams(temperature=1.0, top_k=10**30, max_tokens=12))

    got = _drive(engine, [good[0], bad, good[1], good[2]])

    _, error = got[bad.request_id]
    assert error is not None and "decode step failed for this request" in error
    twins = [make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    want = run_all(reference, twins)
    for r, twin in zip(good, twins, strict=True):
        assert got[r.request_id] == (want[twin.request_id], None)
    stats = engine.stats()
    assert stats.step_failures >= 2  # the batch, then the faulty request alone
    assert stats.free_blocks == 64 and not engine.suspects and not engine.has_work
