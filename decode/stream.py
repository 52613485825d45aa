"""A decode request's outputs as they cross the hop to the ingress: coalesced.

The engine thread hands one ``StepOutput`` per step per request to the request's queue. Each
message to the ingress costs a Serve streaming round trip and the ingress's work per chunk, so
``coalesced`` sends at most one message per wake-up: whatever steps queued while the previous
message was in flight go out as one, and with ``interval_s`` > 0 a stream's messages are held
until that long after the previous one (tokens of a fast stream travel together; vLLM's
``stream_interval`` does the same in tokens). The first message and the last are never held:
time to first token and the end of a request are what clients wait on. A request with several
choices (``n``) shares one queue: what queued is coalesced per choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from decode.outputs import StepOutput


def coalesce(outs: Sequence[StepOutput]) -> StepOutput:
    """Consecutive outputs of one request as one: tokens and log-probabilities in order, the
    last one's finish, error and running speculation totals, the per-step counts summed."""
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
    """``outs`` coalesced per request id, in the order each id first appears."""
    by_id: dict[str, list[StepOutput]] = {}
    for o in outs:
        by_id.setdefault(o.request_id, []).append(o)
    return [coalesce(group) for group in by_id.values()]


async def coalesced(
    q: asyncio.Queue[StepOutput], interval_s: float, sequences: int = 1
) -> AsyncIterator[StepOutput]:
    """The outputs of ``sequences`` sequences (a request's choices) from ``q``, coalesced per
    sequence (module doc), until each has finished or one has failed (an error ends them all).
    A sequence's end is never held back by the interval."""
    loop = asyncio.get_running_loop()
    sent_at: float | None = None  # when the previous message went out (None: none yet)
    left = sequences  # sequences not yet finished

    def last(outs: list[StepOutput]) -> bool:  # the batch ends the stream
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
