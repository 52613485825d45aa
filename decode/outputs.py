"""What the decode engine reports: per request per step, and about itself (``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass

from models.logprobs import TokenLogprob


@dataclass(frozen=True)
class SpecUsage:
    """Speculation outcomes of one request so far (the ``usage.speculative`` object)."""

    num_steps: int  # steps that tested at least one draft token
    draft_tokens: int  # a draft tree counts its depth (positions offered), not its nodes
    accepted_tokens: int
    emitted_tokens: int  # tokens those steps produced


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None  # a models.request.FinishReason value once finished
    spec: SpecUsage
    error: str | None = None
    step_drafted: int = 0  # draft tokens this step tested for the request
    step_accepted: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when the request asks
    choice: int = 0  # which of the request's choices (``Request.choice``)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters (``DecodeServer.stats`` reports them, e.g. to ``/health``)."""

    num_blocks: int
    free_blocks: int
    waiting: int
    pulling: int
    running: int
    target_tokens_fed: int  # tokens the target computed on this replica (prompts included)
    draft_tokens_fed: int  # tokens the draft model computed on this replica
    steps: int
    preemptions: int
    kv_recomputed: int  # requests whose pull failed and whose prompt was computed here
    stalled: int = 0  # requests ended after max_stalled_preemptions with no progress
    kv_handoffs: int = 0  # handoffs whose pull ended, landed or failed
    kv_recent_handoffs: int = 0  # of the latest kv_health_window of them, how many there are
    kv_recent_failed: int = 0  # and how many of those failed
    quarantined_blocks: int = 0  # blocks a released-but-active read may still land in
