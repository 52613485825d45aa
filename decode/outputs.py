"""What the decode engine reports per request per step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecUsage:
    """Speculation outcomes of one request so far (the ``usage.speculative`` object)."""

    num_steps: int  # steps that tested at least one draft token
    draft_tokens: int
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
