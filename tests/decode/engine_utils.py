"""Drive engines in-process (no Ray): the same components the Serve deployments wrap."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from decode.engine import DecodeEngine
from kvtransfer.handoff import KVHandoff
from models.logprobs import TokenLogprob
from models.request import Request
from models.sampling import SamplingParams
from prefill.worker import PrefillWorker
from speculation.goodput import expected_tokens
from speculation.step_time import StepTimeModel


def make_request(prompt: Sequence[int], sp: SamplingParams) -> Request:
    return Request(uuid.uuid4().hex, list(prompt), sp)


def run_all(
    engine: DecodeEngine,
    reqs: Sequence[Request],
    prefill: PrefillWorker | None = None,
    timeout_s: float = 120.0,
    logprobs: dict[str, list[TokenLogprob]] | None = None,
) -> dict[str, list[int]]:
    """Admit every request at once (through prefill when given); return their output tokens
    (and gather the log-probabilities reported for them into ``logprobs`` when given).

    Bounded by time, not by steps: a step while a pull is in flight returns at once, and how
    many of those pass before another process serves the read depends on the machine's load."""
    out: dict[str, list[int]] = {}
    done: set[str] = set()
    for r in reqs:
        handoff: KVHandoff | None = None
        out[r.request_id] = []
        if prefill is not None:
            handoff = prefill.prefill(r)
            out[r.request_id].append(handoff.first_token)
            if logprobs is not None and handoff.first_logprob is not None:
                logprobs.setdefault(r.request_id, []).append(handoff.first_logprob)
            if handoff.finish_reason:
                done.add(r.request_id)
                continue
        engine.add(r, handoff)
    deadline = time.monotonic() + timeout_s
    while len(done) < len(reqs) and time.monotonic() < deadline:
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id].extend(o.new_token_ids)
            if logprobs is not None:
                logprobs.setdefault(o.request_id, []).extend(o.logprobs)
            if o.finished:
                done.add(o.request_id)
    assert len(done) == len(reqs), "engine did not finish every request"
    while engine.has_work and time.monotonic() < deadline:  # as the engine loop does: let the
        engine.step()  # transport finish its notices
        time.sleep(0.001)
    if prefill is not None:
        prefill.reap()
    return out


def slowest_tpot(
    alphas: Sequence[float], ks: Sequence[int], model: StepTimeModel, round_s: float = 0.0
) -> float:
    """The largest time per output token a step with speculation lengths ``ks`` gives any of
    its sequences (step time, with ``max(ks)`` draft rounds, over the tokens each expects)."""
    step = model.predict(sum(1 + k for k in ks)) + round_s * max(ks, default=0)
    return max(step / expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))


def step_goodput(
    alphas: Sequence[float], ks: Sequence[int], model: StepTimeModel, round_s: float = 0.0
) -> float:
    """Tokens per second a step with speculation lengths ``ks`` emits, its ``max(ks)`` draft
    rounds included (what ``choose_ks`` maximises)."""
    step = model.predict(sum(1 + k for k in ks)) + round_s * max(ks, default=0)
    return sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)) / step
