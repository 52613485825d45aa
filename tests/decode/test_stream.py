"""Coalescing a decode stream for the hop to the ingress: nothing lost or reordered, the first
and the last message never held, steps that queued up sent as one, and an interval honoured."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time

from decode.outputs import SpecUsage, StepOutput
from decode.stream import coalesce, coalesced
from models.logprobs import TokenLogprob


def _out(i: int, finish: str | None = None) -> StepOutput:
    spec = SpecUsage(num_steps=i, draft_tokens=2 * i, accepted_tokens=i, emitted_tokens=2 * i)
    lp = TokenLogprob(token=i, logprob=-float(i), top=())
    return StepOutput("r", (i, i + 100), finish, spec, None, 2, 1, (lp, lp))


def test_coalesce_keeps_order_and_the_last_totals() -> None:
    merged = coalesce([_out(1), _out(2), _out(3, "length")])
    assert merged.new_token_ids == (1, 101, 2, 102, 3, 103)
    assert [lp.token for lp in merged.logprobs] == [1, 1, 2, 2, 3, 3]
    assert merged.finish_reason == "length" and merged.spec == _out(3).spec
    assert (merged.step_drafted, merged.step_accepted) == (6, 3)
    assert coalesce([_out(4)]) == _out(4)


def _collect(
    puts: list[tuple[float, StepOutput]], interval_s: float, put_at: list[float] | None = None
) -> list[tuple[float, StepOutput]]:
    """Feed ``puts`` (delay before each, output) into a queue; what ``coalesced`` yields, with
    the time since the start (``put_at``, when given, receives when each output was put)."""

    async def run() -> list[tuple[float, StepOutput]]:
        q: asyncio.Queue[StepOutput] = asyncio.Queue()

        async def feed() -> None:
            for delay, out in puts:
                if delay > 0:  # a zero delay puts at once, without letting the reader run
                    await asyncio.sleep(delay)
                q.put_nowait(out)
                if put_at is not None:
                    put_at.append(time.monotonic() - t0)

        t0 = time.monotonic()
        feeder = asyncio.create_task(feed())
        got = [(time.monotonic() - t0, out) async for out in coalesced(q, interval_s)]
        await feeder
        return got

    return asyncio.run(run())


def test_what_queued_goes_as_one_message() -> None:
    puts = [(0.0, _out(1)), (0.0, _out(2)), (0.0, _out(3)), (0.05, _out(4, "stop"))]
    got = _collect(puts, 0.0)
    tokens = [t for _, m in got for t in m.new_token_ids]
    assert tokens == [1, 101, 2, 102, 3, 103, 4, 104]
    assert len(got) == 2 and got[-1][1].finish_reason == "stop"


def test_an_interval_spaces_messages_but_holds_neither_end() -> None:
    """Steps every 20 ms with a 150 ms interval: the first message at once, then about one
    per interval, and the finish as soon as it comes (not at the next interval)."""
    steps = [(0.02, _out(i)) for i in range(1, 30)] + [(0.02, _out(30, "length"))]
    put_at: list[float] = []
    got = _collect(steps, 0.15, put_at)
    assert [t for _, m in got for t in m.new_token_ids] == [
        t for _, o in steps for t in o.new_token_ids
    ]
    assert got[0][1].new_token_ids == (1, 101)  # the first output alone, not held
    assert 4 <= len(got) <= 8  # ~0.6 s of steps at one message per 0.15 s, not 30
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(got)]
    assert all(g >= 0.14 for g in gaps[:-1])
    # the finish went out when it arrived, not at the next interval: it waited less than half
    # what the interval held the other messages' oldest steps in this run (their median)
    held = [t - put_at[m.new_token_ids[0] - 1] for t, m in got[1:-1]]
    assert got[-1][0] - put_at[-1] < statistics.median(held) / 2


def _seq(rid: str, i: int, finish: str | None = None, error: str | None = None) -> StepOutput:
    spec = SpecUsage(num_steps=0, draft_tokens=0, accepted_tokens=0, emitted_tokens=0)
    return StepOutput(rid, (i,), finish, spec, error)


def _drain(outs: list[StepOutput], sequences: int) -> list[StepOutput]:
    async def run() -> list[StepOutput]:
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        for o in outs:
            q.put_nowait(o)
        return [o async for o in coalesced(q, 0.0, sequences)]

    return asyncio.run(run())


def test_choices_sharing_a_queue_are_coalesced_each_and_end_together() -> None:
    """Two sequences (a request's choices) in one queue: each one's queued steps go as one
    message, the stream ends once both have finished and not before, and what follows in the
    queue (another request's leftovers) is not read."""
    outs = [
        _seq("a", 1),
        _seq("b", 10),
        _seq("a", 2, "stop"),
        _seq("b", 11),
        _seq("b", 12, "length"),
    ]
    got = _drain([*outs, _seq("c", 99)], 2)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in got] == [
        ("a", (1, 2), "stop"),
        ("b", (10, 11, 12), "length"),
    ]
    # one finished of two does not end the stream
    partial = _drain([_seq("a", 1, "stop"), _seq("b", 5), _seq("b", 6, "stop")], 2)
    assert [o.finish_reason for o in partial] == ["stop", "stop"]


def test_an_error_of_one_choice_ends_the_stream() -> None:
    got = _drain([_seq("a", 1), _seq("b", 2, "error", "decode failed"), _seq("a", 3)], 3)
    assert [o.request_id for o in got] == ["a", "b"] and got[-1].error == "decode failed"
