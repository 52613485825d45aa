"""The request's path from the ingress: prefill → KV handoff → decode stream → text.

``Generation.run`` yields text deltas and ends with a :class:`Final`. It emits the first token
as soon as prefill returns it (time to first token does not wait for the KV pull), detokenizes
incrementally, and applies stop strings, holding back just enough text that a stop string is
never streamed in part. Leaving the iteration early (stop string, client gone) cancels the
decode stream, which aborts the request on its replica and frees its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError

from cluster.serving_metrics import RequestClock, RequestMetrics
from decode.outputs import SpecUsage
from kvtransfer.handoff import KVHandoff
from models.logprobs import TokenLogprob
from models.request import FinishReason, Request
from models.tokenizer import IncrementalDetokenizer, Tokenizer

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


@dataclass(frozen=True)
class Delta:
    """Text for the client, with the log-probabilities (when the request asks for them) of the
    tokens that arrived since the last delta. A token's log-probability travels with the first
    text sent after it arrives; part of its text may follow in a later delta (text held back
    as a possible stop string, or a character not yet complete)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class _Tokens:
    ids: tuple[int, ...]
    finish_reason: str | None
    spec: SpecUsage
    error: str | None
    logprobs: tuple[TokenLogprob, ...] = ()


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


@dataclass
class Retried:
    """Requests this ingress replica sent again after losing the replica serving them."""

    prefill: int = 0
    decode: int = 0

    def snapshot(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode}


class Generation:
    """Runs requests through the deployments behind the ingress.

    A request that has streamed no token yet is sent again, up to ``retries`` times, when the
    replica serving it is lost (its actor, worker or node died): a prompt whose prefill died,
    or a request that died on decode while queued or pulling. Ray Serve's router drops a dead
    replica when a call to it fails, so the retry lands on another one (or on its replacement).
    A retried decode never pulls the first handoff again: its blocks may be half-read or
    already released and reused on prefill, so decode computes the prompt itself, continuing
    after the first token prefill sent (the same tokens: sampling is seeded per position).
    Anything else (overload, a request the replica refused, a stream cut after tokens) is not
    retried.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prefill: Any | None,
        decode: Any,
        retries: int = 1,
        metrics: RequestMetrics | None = None,
        log_requests: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.log_requests = log_requests  # a line as each generation starts and ends
        self.metrics = metrics  # the standard serving metrics (None: not exported)
        self.prefill = prefill  # DeploymentHandle of PrefillServer; None in colocated mode
        self.decode = decode  # DeploymentHandle of DecodeServer
        self.retries = retries
        self.retried = Retried()

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
            first = () if handoff.first_logprob is None else (handoff.first_logprob,)
            yield _Tokens((handoff.first_token,), handoff.finish_reason, NO_SPEC, None, first)
            if handoff.finish_reason:
                return
        sent = req
        for attempt in range(self.retries + 1):
            stream = self.decode.options(stream=True).generate.remote(sent, handoff)
            finished = streamed = False
            try:
                async for out in stream:
                    finished, streamed = out.finished, True
                    yield _Tokens(
                        out.new_token_ids, out.finish_reason, out.spec, out.error, out.logprobs
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
                    continue
                log.warning("decode of %s failed: %s", req.request_id, e)
                raise GenerationError(f"decode failed: {_cause(e)}") from e
            finally:
                if not finished:
                    stream.cancel()

    def _finished(
        self, req: Request, clock: RequestClock | None, reason: str, num_tokens: int
    ) -> None:
        if clock is not None:
            clock.finished(reason, len(req.prompt_token_ids), num_tokens)
        if self.log_requests:
            log.info("request %s finished (%s): %d tokens", req.request_id, reason, num_tokens)

    async def run(self, req: Request, stops: Sequence[str]) -> AsyncGenerator[Delta | Final, None]:
        """Yield text deltas, then one :class:`Final`. Raises :class:`GenerationError`.

        With a stop string, the log-probabilities reported are those of every token up to the
        one that completed the stop string (the text stops before the string)."""
        detok = IncrementalDetokenizer(self.tokenizer)
        hold = max((len(s) for s in stops), default=1) - 1
        pending = ""
        held: tuple[TokenLogprob, ...] = ()  # of tokens whose text has not been sent
        num_tokens = 0
        spec = NO_SPEC
        clock = self.metrics.start() if self.metrics is not None else None
        prompt = len(req.prompt_token_ids)
        if self.log_requests:
            s = req.sampling
            log.info(
                "request %s: %d prompt tokens, max_tokens %d, temperature %g, top_p %g, seed %s",
                req.request_id,
                prompt,
                s.max_tokens,
                s.temperature,
                s.top_p,
                s.seed if s.seeded else None,
            )
        tokens = self._tokens(req)
        try:
            async for chunk in tokens:
                num_tokens += len(chunk.ids)
                if clock is not None:
                    clock.tokens_arrived(len(chunk.ids))
                spec = chunk.spec if chunk.spec.num_steps or chunk.spec.draft_tokens else spec
                if chunk.error:
                    raise GenerationError(chunk.error)
                pending += detok.push(chunk.ids)
                held += chunk.logprobs
                done = chunk.finish_reason is not None
                if done:
                    pending += detok.flush()
                cut = _find_stop(pending, stops)
                if cut is not None:
                    if cut or held:
                        yield Delta(pending[:cut], held)
                    self._finished(req, clock, FinishReason.STOP.value, num_tokens)
                    yield Final(FinishReason.STOP.value, prompt, num_tokens, spec)
                    return
                safe = len(pending) if done else max(0, len(pending) - hold)
                if safe or (done and held):
                    yield Delta(pending[:safe], held)
                    pending, held = pending[safe:], ()
                if done:
                    assert chunk.finish_reason is not None
                    self._finished(req, clock, chunk.finish_reason, num_tokens)
                    yield Final(chunk.finish_reason, prompt, num_tokens, spec)
                    return
        finally:
            await tokens.aclose()
        raise GenerationError("the decode stream ended without finishing the request")


def _replica_lost(e: BaseException) -> bool:
    """Whether ``e`` says the replica (its actor, worker process or node) is gone, the one
    failure a resend to another replica cures."""
    return isinstance(e, RayActorError | WorkerCrashedError | NodeDiedError)


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
