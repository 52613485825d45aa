"""The request's path from the ingress: prefill → KV handoff → decode stream → text. Stop
strings are matched here, on text, which only the ingress has; leaving ``Generation.run`` early
cancels the decode stream, which aborts the request on its replica and frees its KV blocks."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError

from decode.outputs import SpecUsage
from kvtransfer.handoff import KVHandoff, LeaseRelease
from models.logprobs import TokenLogprob
from models.request import FinishReason, Request
from models.tokenizer import IncrementalDetokenizer, Tokenizer
from serving.serving_metrics import RequestClock, RequestMetrics

log = logging.getLogger(__name__)
NO_SPEC = SpecUsage(0, 0, 0, 0)
_OVERLOADED = "the {pool} pool's queue is full ({pool}.max_queued_requests); retry shortly"


class GenerationError(RuntimeError):
    """The serving path failed for this request (a replica died, KV transfer failed, ...)."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Final:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    spec: SpecUsage
    index: int = 0


@dataclass(frozen=True)
class Delta:
    """Text for the client, with the log-probabilities of the tokens that arrived since the last
    delta (part of a token's text may follow later: held back as a possible stop string)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0


@dataclass(frozen=True)
class _Tokens:
    ids: tuple[int, ...]
    finish_reason: str | None
    spec: SpecUsage
    error: str | None
    logprobs: tuple[TokenLogprob, ...] = ()
    choice: int = 0


def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The first stop string in ``text``: (where it starts, which)."""
    hits = [(i, s) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    return min(hits, key=lambda h: h[0]) if hits else None


@dataclass(frozen=True)
class TextOptions:
    """How tokens become the client's text (vLLM's request fields of these names)."""

    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass
class Retried:
    """Requests this ingress replica sent again after losing the replica serving them."""

    prefill: int = 0
    decode: int = 0

    def snapshot(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode}


class Generation:
    """Runs requests through the deployments behind the ingress. A request that streamed no
    token yet is resent (up to ``retries``) when its replica is lost; a resent decode computes the
    prompt itself, since the first handoff's blocks may already be released and reused."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prefill: Any | None,
        decode: Any,
        retries: int = 1,
        metrics: RequestMetrics | None = None,
        log_requests: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.log_requests = log_requests
        self.metrics = metrics
        self.prefill = prefill  # None in colocated mode
        self.decode = decode
        self.retries = retries
        self.retried = Retried()
        self.dropped_handoffs = 0  # leases given back unused (shown in /health)
        self._releasing: set[asyncio.Future[None]] = set()

    async def _prefill(self, req: Request) -> KVHandoff:
        assert self.prefill is not None
        for attempt in range(self.retries + 1):
            try:
                handoff: KVHandoff = await self.prefill.prefill.remote(req)
                return handoff
            except BackPressureError as e:
                raise GenerationError(_OVERLOADED.format(pool="prefill"), status=429) from e
            except Exception as e:
                if attempt < self.retries and _replica_lost(e):
                    log.warning("prefill of %s lost its replica (%s); retrying", req.request_id, e)
                    self.retried.prefill += 1
                    continue
                log.warning("prefill of %s failed: %s", req.request_id, e)
                raise GenerationError(f"prefill failed: {_cause(e)}") from e
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _tokens(self, req: Request) -> AsyncGenerator[_Tokens, None]:
        handoff = None
        if self.prefill is not None:
            handoff = await self._prefill(req)
        # a handoff no decode replica took goes back to its prefill replica at once; once decode
        # streams a token of its own, its read of the blocks has ended (and ended the lease)
        held = handoff if handoff is not None and handoff.has_blocks else None
        chunks = 0
        try:
            async with aclosing(self._decode(req, handoff)) as stream:
                async for tokens in stream:
                    if tokens is None:  # resent without the handoff: decode computes the prompt
                        self._release(held)
                        held = None
                        continue
                    chunks += 1
                    if chunks > 1 and tokens.ids:  # a token of decode's own: it read the KV
                        held = None
                    yield tokens
            held = None
        finally:
            self._release(held)

    def _release(self, handoff: KVHandoff | None) -> None:
        if handoff is None or self.prefill is None:
            return
        self.dropped_handoffs += 1
        # from a task of its own, in a fresh context: Serve cancels the calls a cancelled request
        # made in its context, and the caller is often being cancelled (its client left)
        task = asyncio.get_running_loop().create_task(
            self._send_release(LeaseRelease.of(handoff)), context=contextvars.Context()
        )
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _send_release(self, release: LeaseRelease) -> None:
        assert self.prefill is not None
        try:
            await self.prefill.release.remote(release)
        except Exception as e:  # the replica is gone, and its leases with it
            log.warning("releasing the lease of %s failed: %s", release.request_id, e)

    async def _decode(
        self, req: Request, handoff: KVHandoff | None
    ) -> AsyncGenerator[_Tokens | None, None]:
        """The request's tokens from prefill's first on; None where it was resent to another
        decode replica without the handoff."""
        if handoff is not None:
            received = time.monotonic()
            first = () if handoff.first_logprob is None else (handoff.first_logprob,)
            yield _Tokens((handoff.first_token,), handoff.finish_reason, NO_SPEC, None, first)
            if handoff.finish_reason and req.sampling.n == 1:
                return  # (with more choices, decode still runs the others on its KV)
            # the lease ran while the client took the first token: decode learns what is left
            handoff = handoff.held(time.monotonic() - received, time.time())
        sent = req
        for attempt in range(self.retries + 1):
            stream = self.decode.options(stream=True).generate.remote(sent, handoff)
            finished = streamed = False
            try:
                async for out in stream:
                    finished, streamed = out.finished, True
                    yield _Tokens(
                        out.new_token_ids,
                        out.finish_reason,
                        out.spec,
                        out.error,
                        out.logprobs,
                        out.choice,
                    )
                return
            except BackPressureError as e:
                finished = True  # never placed on a replica: nothing to cancel (cancel re-raises)
                raise GenerationError(_OVERLOADED.format(pool="decode"), status=429) from e
            except Exception as e:
                if not streamed and attempt < self.retries and _replica_lost(e):
                    log.warning("decode of %s lost its replica (%s); retrying", req.request_id, e)
                    self.retried.decode += 1
                    if handoff is not None:  # computed on decode, after prefill's first token
                        sent = replace(req, output_token_ids=[handoff.first_token])
                        handoff = None
                        yield None
                    continue
                log.warning("decode of %s failed: %s", req.request_id, e)
                raise GenerationError(f"decode failed: {_cause(e)}") from e
            finally:
                if not finished:
                    stream.cancel()

    async def run(
        self, req: Request, stops: Sequence[str], text: TextOptions | None = None
    ) -> AsyncGenerator[Delta | Final, None]:
        """Yield text deltas and one :class:`Final` per choice; the last Final ends the iteration.
        Raises :class:`GenerationError`."""
        n = req.sampling.n
        prompt = len(req.prompt_token_ids)
        how = text if text is not None else TextOptions()
        choices = [
            _ChoiceText(
                i,
                prompt,
                IncrementalDetokenizer(self.tokenizer, how.skip_special_tokens),
                stops,
                self.metrics.start() if self.metrics is not None else None,
                how.include_stop_str_in_output,
            )
            for i in range(n)
        ]
        if self.log_requests:
            s = req.sampling
            log.info(
                "request %s: %d prompt tokens, max_tokens %d, n %d, temperature %g, top_p %g, "
                "seed %s",
                req.request_id,
                prompt,
                s.max_tokens,
                n,
                s.temperature,
                s.top_p,
                s.seed if s.seeded else None,
            )
        left = n
        tokens = self._tokens(req)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                try:  # a timeout cancels the decode stream: its replica frees the request's KV
                    chunk = await asyncio.wait_for(anext(tokens), deadline - time.monotonic())
                except StopAsyncIteration:
                    break
                except TimeoutError as e:
                    raise GenerationError(
                        f"the request did not finish within {self.timeout_s:g} s "
                        "(limits.request_timeout_s)",
                        status=504,
                    ) from e
                c = choices[chunk.choice]
                if c.ended:  # ended on a stop string (or on prefill): the rest is not wanted
                    continue
                if chunk.error:
                    raise GenerationError(chunk.error)
                for item in c.push(chunk):
                    if isinstance(item, Final):
                        self._finished(req, c, item, prompt if c.index == 0 else 0)
                        left -= 1
                    yield item
                if left == 0:
                    return
        finally:
            await tokens.aclose()
        raise GenerationError("the decode stream ended without finishing the request")

    def _finished(self, req: Request, c: _ChoiceText, final: Final, prompt: int) -> None:
        if c.clock is not None:
            c.clock.finished(final.finish_reason, prompt, final.completion_tokens)
        if self.log_requests:
            which = f" choice {c.index}" if req.sampling.n > 1 else ""
            log.info(
                "request %s%s finished (%s): %d tokens",
                req.request_id,
                which,
                final.finish_reason,
                final.completion_tokens,
            )


class _ChoiceText:
    """One choice's tokens turned into text, holding back what could still become a stop string."""

    def __init__(
        self,
        index: int,
        prompt_tokens: int,
        detok: IncrementalDetokenizer,
        stops: Sequence[str],
        clock: RequestClock | None,
        include_stop: bool = False,
    ) -> None:
        self.include_stop = include_stop
        self.index = index
        self.prompt_tokens = prompt_tokens
        self.detok = detok
        self.stops = stops
        self.clock = clock
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.held: tuple[TokenLogprob, ...] = ()  # of tokens whose text has not been sent
        self.num_tokens = 0
        self.spec = NO_SPEC
        self.ended = False

    def push(self, chunk: _Tokens) -> list[Delta | Final]:
        """What the client gets for ``chunk``: a delta, and the choice's Final if it ended."""
        self.num_tokens += len(chunk.ids)
        if self.clock is not None:
            self.clock.tokens_arrived(len(chunk.ids))
        if chunk.spec.num_steps or chunk.spec.draft_tokens:
            self.spec = chunk.spec
        self.pending += self.detok.push(chunk.ids)
        self.held += chunk.logprobs
        done = chunk.finish_reason is not None
        if done:
            self.pending += self.detok.flush()
        out: list[Delta | Final] = []
        hit = _find_stop(self.pending, self.stops)
        if hit is not None:
            cut = hit[0] + (len(hit[1]) if self.include_stop else 0)
            if cut or self.held:
                out.append(Delta(self.pending[:cut], self.held, self.index))
            return [*out, self._end(FinishReason.STOP.value)]
        safe = len(self.pending) if done else max(0, len(self.pending) - self.hold)
        if safe or (done and self.held):
            out.append(Delta(self.pending[:safe], self.held, self.index))
            self.pending, self.held = self.pending[safe:], ()
        if chunk.finish_reason is not None:
            out.append(self._end(chunk.finish_reason))
        return out

    def _end(self, reason: str) -> Final:
        self.ended = True
        return Final(reason, self.prompt_tokens, self.num_tokens, self.spec, self.index)


def _replica_lost(e: BaseException) -> bool:
    """The replica is gone: the one failure a resend to another replica cures."""
    return isinstance(e, RayActorError | WorkerCrashedError | NodeDiedError)


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
