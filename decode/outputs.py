"""What the decode engine reports: per request per step, and about itself (``EngineStats``)."""

from __future__ import annotations

from dataclasses import dataclass

from models.logprobs import TokenLogprob


@dataclass(frozen=True)
class SpecUsage:
    """One request's ``usage.speculative`` so far."""

    num_steps: int
    draft_tokens: int  # a draft tree counts its depth, not its nodes
    accepted_tokens: int
    emitted_tokens: int
    # steps that accepted exactly j drafts, for j = 0 .. the most a step drafted (vLLM's)
    histogram: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None
    spec: SpecUsage
    error: str | None = None
    step_drafted: int = 0
    step_accepted: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    choice: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    waiting: int
    pulling: int
    running: int
    target_tokens_fed: int
    draft_tokens_fed: int
    steps: int
    preemptions: int
    kv_recomputed: int  # requests whose pull failed and whose prompt was computed here
    stalled: int = 0  # requests ended after max_stalled_preemptions with no progress
    kv_handoffs: int = 0
    kv_recent_handoffs: int = 0  # within the latest kv_health_window
    kv_recent_failed: int = 0
    quarantined_blocks: int = 0  # blocks a read may still land in
    retired_blocks: int = 0  # of reads that never ended within kv.quarantine_timeout_s
    queue_timeouts: int = 0  # requests ended after decode.max_queue_wait_s without blocks
    step_failures: int = 0  # steps that raised (each then isolated to the request at fault)
    steps_overlapped: int = 0  # planned and launched while the step before was in the air
