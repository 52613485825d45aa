"""Decode outputs coalesced for the hop to the ingress (each message is a Serve round trip): one
message per wake-up, held ``interval_s`` after the previous; the first and last are never held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from decode.outputs import StepOutput


def coalesce(outs: Sequence[StepOutput]) -> StepOutput:
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    return StepOutput(
        request_id=last.request_id,
        new_token_ids=tuple(t for o in outs for t in o.new_token_ids),
        finish_reason=last.finish_reason,
        spec=last.spec,
        error=last.error,
        step_drafted=sum(o.step_drafted for o in outs),
        step_accepted=sum(o.step_accepted for o in outs),
        logprobs=tuple(lp for o in outs for lp in o.logprobs),
    )


def _per_sequence(outs: Sequence[StepOutput]) -> list[StepOutput]:
    by_id: dict[str, list[StepOutput]] = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    return [coalesce(group) for group in by_id.values()]


async def coalesced(
    q: asyncio.Queue[StepOutput], interval_s: float, sequences: int = 1
) -> AsyncIterator[StepOutput]:
    """``sequences`` choices' outputs, coalesced per choice, until all end or one fails."""
    loop = asyncio.get_running_loop()
    sent_at: float | None = None
    left = sequences

    def last(outs: list[StepOutput]) -> bool:
        return any(o.error is not None for o in outs) or sum(o.finished for o in outs) >= left

    while True:
        outs = [await q.get()]
        if sent_at is not None and interval_s > 0:
            deadline = sent_at + interval_s
            while not outs[-1].finished and (wait := deadline - loop.time()) > 0:
                try:
                    outs.append(await asyncio.wait_for(q.get(), wait))
                except TimeoutError:
                    break
        while not last(outs) and not q.empty():
            outs.append(q.get_nowait())
        ending = last(outs)
        sent_at = loop.time()
        for out in _per_sequence(outs):
            yield out
        if ending:
            return
        left -= sum(o.finished for o in outs)
