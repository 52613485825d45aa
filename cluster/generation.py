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
from dataclasses import dataclass
from typing import Any

from ray.serve.exceptions import BackPressureError

from decode.outputs import SpecUsage
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
class _Tokens:
    ids: tuple[int, ...]
    finish_reason: str | None
    spec: SpecUsage
    error: str | None


def _find_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class Generation:
    """Runs requests through the deployments behind the ingress."""

    def __init__(self, tokenizer: Tokenizer, prefill: Any | None, decode: Any) -> None:
        self.tokenizer = tokenizer
        self.prefill = prefill  # DeploymentHandle of PrefillServer; None in colocated mode
        self.decode = decode  # DeploymentHandle of DecodeServer

    async def _tokens(self, req: Request) -> AsyncGenerator[_Tokens, None]:
        handoff = None
        if self.prefill is not None:
            try:
                handoff = await self.prefill.prefill.remote(req)
            except BackPressureError as e:
                raise GenerationError(_OVERLOADED.format(pool="prefill"), status=429) from e
            except Exception as e:
                log.warning("prefill of %s failed: %s", req.request_id, e)
                raise GenerationError(f"prefill failed: {_cause(e)}") from e
            yield _Tokens((handoff.first_token,), handoff.finish_reason, NO_SPEC, None)
            if handoff.finish_reason:
                return
        stream = self.decode.options(stream=True).generate.remote(req, handoff)
        finished = False
        try:
            async for out in stream:
                finished = out.finished
                yield _Tokens(out.new_token_ids, out.finish_reason, out.spec, out.error)
        except BackPressureError as e:
            finished = True  # never placed on a replica: nothing to cancel (cancel re-raises)
            raise GenerationError(_OVERLOADED.format(pool="decode"), status=429) from e
        except Exception as e:
            log.warning("decode of %s failed: %s", req.request_id, e)
            raise GenerationError(f"decode failed: {_cause(e)}") from e
        finally:
            if not finished:
                stream.cancel()

    async def run(self, req: Request, stops: Sequence[str]) -> AsyncGenerator[str | Final, None]:
        """Yield text deltas, then one :class:`Final`. Raises :class:`GenerationError`."""
        detok = IncrementalDetokenizer(self.tokenizer)
        hold = max((len(s) for s in stops), default=1) - 1
        pending = ""
        num_tokens = 0
        spec = NO_SPEC
        tokens = self._tokens(req)
        try:
            async for chunk in tokens:
                num_tokens += len(chunk.ids)
                spec = chunk.spec if chunk.spec.num_steps or chunk.spec.draft_tokens else spec
                if chunk.error:
                    raise GenerationError(chunk.error)
                pending += detok.push(chunk.ids)
                done = chunk.finish_reason is not None
                if done:
                    pending += detok.flush()
                cut = _find_stop(pending, stops)
                if cut is not None:
                    if cut:
                        yield pending[:cut]
                    yield Final(
                        FinishReason.STOP.value, len(req.prompt_token_ids), num_tokens, spec
                    )
                    return
                safe = len(pending) if done else max(0, len(pending) - hold)
                if safe:
                    yield pending[:safe]
                    pending = pending[safe:]
                if done:
                    assert chunk.finish_reason is not None
                    yield Final(chunk.finish_reason, len(req.prompt_token_ids), num_tokens, spec)
                    return
        finally:
            await tokens.aclose()
        raise GenerationError("the decode stream ended without finishing the request")


def _cause(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
