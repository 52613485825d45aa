"""A decode replica's speculation counters, for Prometheus and, as the same totals, ``/health``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_POSITION = 16  # per-position counters cover draft positions 1..16 (k is at most 16)


@dataclass
class SpecTotals:
    drafts: int = 0  # verification steps that tested at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    drafted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_POSITION)
    accepted_by_position: list[int] = field(default_factory=lambda: [0] * MAX_POSITION)


class SpecMetrics:
    def __init__(self, deployment: str, model_name: str = "") -> None:
        from ray.util.metrics import Counter, Gauge

        tags = ("deployment", "model_name")
        pos = ("deployment", "model_name", "position")
        self.tags = {"deployment": deployment, "model_name": model_name}
        self.totals = SpecTotals()
        self._drafts = Counter("tandem_spec_drafts", "Steps that verified draft tokens", tags)
        self._draft = Counter("tandem_spec_draft_tokens", "Draft tokens verified", tags)
        self._accepted = Counter("tandem_spec_accepted_tokens", "Draft tokens accepted", tags)
        self._emitted = Counter("tandem_spec_emitted_tokens", "Tokens emitted by those steps", tags)
        self._drafted_at = Counter(
            "tandem_spec_draft_tokens_by_position", "Draft tokens verified, by position", pos
        )
        self._accepted_at = Counter(
            "tandem_spec_accepted_tokens_by_position", "Draft tokens accepted, by position", pos
        )
        self._collapsed = Gauge(
            "tandem_acceptance_collapsed_cells",
            "Calibration cells whose drafts' realised acceptance fell below "
            "decode.acceptance_alarm_ratio of the predicted (speculation/acceptance_alarm.py)",
            tags,
        )
        for c in (self._drafts, self._draft, self._accepted, self._emitted, self._collapsed):
            c.set_default_tags(self.tags)

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        if drafted <= 0:
            return
        t = self.totals
        t.drafts += 1
        t.draft_tokens += drafted
        t.accepted_tokens += accepted
        t.emitted_tokens += emitted
        self._drafts.inc(1)
        self._draft.inc(drafted)
        if accepted:
            self._accepted.inc(accepted)
        self._emitted.inc(emitted)
        for j in range(min(drafted, MAX_POSITION)):
            tags = {**self.tags, "position": str(j + 1)}
            t.drafted_by_position[j] += 1
            self._drafted_at.inc(1, tags)
            if j < accepted:
                t.accepted_by_position[j] += 1
                self._accepted_at.inc(1, tags)

    def collapsed_cells(self, n: int) -> None:
        self._collapsed.set(n)

    def snapshot(self) -> dict[str, Any]:
        t = self.totals
        return {
            "drafts": t.drafts,
            "draft_tokens": t.draft_tokens,
            "accepted_tokens": t.accepted_tokens,
            "emitted_tokens": t.emitted_tokens,
            "acceptance_rate": t.accepted_tokens / t.draft_tokens if t.draft_tokens else None,
            "acceptance_by_position": [
                a / d if d else None
                for a, d in zip(t.accepted_by_position, t.drafted_by_position, strict=True)
            ],
        }
