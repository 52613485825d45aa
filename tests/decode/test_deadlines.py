"""Every wait on a decode replica has a deadline: a request waiting for KV blocks ends after
``max_queue_wait_s`` naming it; the engine loop idles while nothing can progress; and the
progress watchdog reports an engine that has work but finishes no step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from decode.config import DecodeEngineConfig
from decode.engine import BLOCKED_WAIT_S, DecodeEngine
from decode.loop import EngineLoop
from decode.outputs import StepOutput
from models.sampling import SamplingParams
from models.spec import DraftSpec, ModelSpec
from tests.decode.engine_utils import make_request
from tests.helpers import wait_until

LONG = SamplingParams(temperature=0.0, max_tokens=200)


@pytest.fixture(scope="module")
def target(tiny_folder: Path) -> ModelSpec:
    return ModelSpec(str(tiny_folder))


def test_a_request_waiting_for_blocks_ends_after_max_queue_wait(target: ModelSpec) -> None:
    """Before, a request that did not fit the pool less its quarantined blocks waited forever,
    and the loop spun a core meanwhile."""
    cfg = DecodeEngineConfig("t", target, DraftSpec(), num_blocks=16, max_queue_wait_s=0.3)
    engine = DecodeEngine(cfg)
    blocker = engine.allocator.allocate(14)  # as if quarantined behind reads that never end
    waiting = make_request([5] * 40, LONG)
    engine.add(waiting, None)
    engine.step()
    assert len(engine.waiting) == 1 and engine.idle_wait_s == BLOCKED_WAIT_S
    engine.allocator.free(blocker[:2])
    assert engine.idle_wait_s == 0.0  # it would fit now: step at once
    engine.allocator.allocate(2)
    outs: list[StepOutput] = []
    deadline = time.monotonic() + 30
    while not outs:
        assert time.monotonic() < deadline
        time.sleep(engine.idle_wait_s)  # as the loop waits
        outs += engine.step()
    [late] = outs
    assert late.request_id == waiting.request_id and late.finish_reason == "error"
    assert "decode.max_queue_wait_s" in (late.error or "")
    assert engine.stats().queue_timeouts == 1 and not engine.has_work


class _Wedged(DecodeEngine):
    """The real engine whose steps hang once ``wedge`` is set (a hung collective or device)."""

    wedge = False

    def step(self) -> list[StepOutput]:
        while self.wedge:
            time.sleep(0.01)
        return super().step()


def test_the_watchdog_sees_an_engine_with_work_and_no_step(target: ModelSpec) -> None:
    cfg = DecodeEngineConfig("t", target, DraftSpec(), num_blocks=32)
    loop = EngineLoop(lambda: _Wedged(cfg), lambda out: None)
    engine = loop.start()
    assert isinstance(engine, _Wedged)
    try:
        time.sleep(0.2)
        assert loop.stalled_s() == 0.0  # idle: nothing to do is not a stall
        engine.wedge = True
        loop.submit(make_request([5] * 20, LONG), None)
        wait_until(lambda: loop.stalled_s() > 0.5, 10, "a stall measured")
        engine.wedge = False
        wait_until(lambda: loop.stalled_s() < 0.5, 10, "progress again")
    finally:
        engine.wedge = False
        loop.stop()
