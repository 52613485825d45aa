"""Capacity follows the served loop: the engine loop measures what each busy cycle spends beyond
the step's forwards, and the capacity within a TPOT SLO counts it. A loop whose delivery of
outputs is slowed by 5 ms a step (as a busy event loop or a shared core would) reports about
that much more overhead than the same loop undelayed, and a smaller capacity."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.loop import EngineLoop
from decode.outputs import StepOutput
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from speculation.capacity import capacity_within_slo
from speculation.loop_cycle import CycleOverhead
from tests.decode.engine_utils import make_request
from tests.helpers import wait_until

DELAY_S = 0.005


def test_the_overhead_is_the_median_gap_once_enough_cycles_are_in() -> None:
    c = CycleOverhead(window=8, min_samples=3)
    c.observe(0.012, 0.010)
    c.observe(0.013, 0.010)
    assert c.seconds == 0.0  # the start-up calibration alone until min_samples
    c.observe(0.050, 0.010)  # one stall does not move the median
    assert c.seconds == pytest.approx(0.003)
    c.observe(0.009, 0.010)  # a cycle shorter than its step (clock jitter) counts as none
    assert c.samples == 4 and c.seconds == pytest.approx(0.0025)


def _served_overhead(target: ModelSpec, delay_s: float) -> tuple[float, int, DecodeEngine]:
    draft = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=3)  # adaptive: a step-time model
    cfg = DecodeEngineConfig("t", target, draft, num_blocks=64, max_batch_size=4)
    done: list[str] = []

    def deliver(out: StepOutput) -> None:
        time.sleep(delay_s)  # the loop hands each output over before its next step
        if out.finished:
            done.append(out.request_id)

    loop = EngineLoop(lambda: DecodeEngine(cfg), deliver)
    engine = loop.start()
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=80)  # no stop ids: all 80 tokens
        reqs = [make_request([5 + i] * 12, sp) for i in range(2)]
        for r in reqs:
            loop.submit(r, None)
        wait_until(lambda: len(done) == len(reqs), 120, "both requests served")
        return engine.cycle.seconds, engine.cycle.samples, engine
    finally:
        loop.stop()


def test_the_loop_measures_its_cycles_and_capacity_counts_them(tiny_folder: Path) -> None:
    target = ModelSpec(str(tiny_folder))
    plain, n_plain, engine = _served_overhead(target, 0.0)
    slowed, n_slowed, _ = _served_overhead(target, DELAY_S)
    assert n_plain >= 10 and n_slowed >= 10
    # two outputs a step (one per stream), each delayed: about 2 x DELAY_S more a cycle
    assert slowed - plain > 1.5 * DELAY_S, (plain, slowed)
    stats = engine.routing_stats()
    assert stats.cycle_overhead_s == pytest.approx(plain)
    slo = 0.05
    base = replace(stats, cycle_overhead_s=0.0)
    heavier = replace(stats, cycle_overhead_s=0.02)
    a, b = capacity_within_slo(base, slo), capacity_within_slo(heavier, slo)
    assert a is not None and b is not None  # an adaptive engine publishes its step-time model
    assert b.capacity_goodput_tok_s < a.capacity_goodput_tok_s
