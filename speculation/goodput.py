"""The goodput model (emitted tokens per second) and the speculation lengths that maximise it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from speculation.step_time import StepTimeModel

GUARD_MAX_LOSS = 0.1


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits for ``k`` drafts at acceptance ``a``: ``(1 - a^(k+1)) / (1 - a)``."""
    a = min(max(alpha, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def goodput(alphas: Sequence[float], ks: Sequence[int], model: StepTimeModel) -> float:
    tokens = sum(1 + k for k in ks)
    if tokens == 0:
        return 0.0
    emitted = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
    return emitted / model.predict(tokens)


@dataclass(frozen=True)
class DraftBatch:
    alphas: Sequence[float]
    caps: int | Sequence[int]
    widths: Sequence[int] | None = None  # tokens per draft level (a tree's width); None: 1
    pays_rounds: Sequence[bool] | None = None  # drafted by the model (runs rounds); None: all


@dataclass(frozen=True)
class StepCosts:
    """Costs beyond the sequences' tokens: ``fixed_tokens`` (prompt chunks) in the forward, a floor
    ``per_draft_s`` per draft token, and ``round_s`` per draft round beyond ``paid_rounds``."""

    model: StepTimeModel
    token_budget: int | None = None
    fixed_tokens: int = 0
    per_draft_s: float | None = None
    round_s: float = 0.0
    paid_rounds: int = 0


@dataclass(frozen=True)
class TpotGuard:
    """TPOT SLO for drafting (None: none) and the most goodput keeping to it may cost (1: any)."""

    slo_s: float | None = None
    max_loss: float = GUARD_MAX_LOSS


NO_GUARD = TpotGuard()


def choose_ks(batch: DraftBatch, step: StepCosts, guard: TpotGuard = NO_GUARD) -> list[int]:
    """Speculation length per sequence that maximises the step's goodput, drafts taken by gain
    per token. With ``guard.slo_s`` every sequence's TPOT must keep to the SLO unless that costs
    more than ``guard.max_loss`` of the goodput."""
    n = len(batch.alphas)
    caps = np.clip(np.broadcast_to(np.asarray(batch.caps, dtype=np.int64), (n,)), 0, None)
    if n == 0 or caps.max() <= 0:
        return [0] * n
    cost = np.ones(n, np.int64) if batch.widths is None else np.asarray(batch.widths, np.int64)
    full = int(caps @ cost)
    room = full if step.token_budget is None else min(full, step.token_budget - n)
    payer = np.ones(n, bool) if batch.pays_rounds is None else np.asarray(batch.pays_rounds, bool)
    alphas = np.clip(np.asarray(batch.alphas, dtype=np.float64), 0.0, 1.0)
    plan = _Batch(alphas, caps, cost, payer, room)
    steps = _Steps.of(step.model, n, step.fixed_tokens, step.per_draft_s, guard.slo_s)
    kept, free = _best_plans(plan, step, steps)
    if guard.max_loss >= 1 or kept.goodput >= (1 - guard.max_loss) * free.goodput:
        return kept.ks
    return free.ks


@dataclass(frozen=True)
class _Batch:
    alphas: npt.NDArray[np.float64]
    caps: npt.NDArray[np.int64]
    cost: npt.NDArray[np.int64]
    payer: npt.NDArray[np.bool_]
    room: int


@dataclass(frozen=True)
class _Plan:
    ks: list[int]
    goodput: float


def _best_plans(b: _Batch, step: StepCosts, steps: _Steps) -> tuple[_Plan, _Plan]:
    if step.round_s <= 0:
        return _by_gain(b, steps, 0.0)
    # rounds are paid per step by the deepest drafting payer: try every depth it may reach
    top = int(b.caps[b.payer].max()) if b.payer.any() else 0
    kept = free = _Plan([0] * len(b.alphas), -1.0)
    for depth in range(min(step.paid_rounds, top), top + 1):
        capped = np.where(b.payer, np.minimum(b.caps, depth), b.caps)
        rounds_s = step.round_s * max(depth - step.paid_rounds, 0)
        k, f = _by_gain(_Batch(b.alphas, capped, b.cost, b.payer, b.room), steps, rounds_s)
        kept = k if k.goodput > kept.goodput else kept
        free = f if f.goodput > free.goodput else free
    return kept, free


@dataclass(frozen=True)
class _Steps:
    model: StepTimeModel
    n: int
    fixed_tokens: int
    per_draft_s: float | None
    decodes_s: float
    mixed_s: float
    tpot_limit_s: float  # inf: no SLO

    @classmethod
    def of(
        cls,
        model: StepTimeModel,
        n: int,
        fixed_tokens: int,
        per_draft_s: float | None,
        tpot_slo_s: float | None = None,
    ) -> _Steps:
        mixed = model.predict(n + fixed_tokens)
        limit = math.inf if tpot_slo_s is None else max(tpot_slo_s, mixed)
        return cls(model, n, fixed_tokens, per_draft_s, model.predict(n), mixed, limit)

    def added_many(self, drafts: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """[J] what each draft count ``d`` adds: ``T(n + fixed + d) - T(n + fixed)``."""
        added = self.model.predict_many(self.n + self.fixed_tokens + drafts) - self.mixed_s
        if self.per_draft_s is None:
            return added
        out: npt.NDArray[np.float64] = np.maximum(added, self.per_draft_s * drafts)
        return out


def _by_gain(b: _Batch, steps: _Steps, rounds_s: float) -> tuple[_Plan, _Plan]:
    """(best plan within the SLO, best plan) over prefixes of the levels by gain per token."""
    n = len(b.alphas)
    caps = np.asarray(b.caps, dtype=np.int64)
    cost = np.asarray(b.cost, dtype=np.int64)
    alphas = np.asarray(b.alphas, dtype=np.float64)
    seq = np.repeat(np.arange(n), np.maximum(caps, 0))  # [L] every (sequence, level)
    level = (
        np.arange(seq.size) - np.repeat(np.cumsum(caps.clip(0)) - caps.clip(0), caps.clip(0)) + 1
    )
    gain = alphas[seq] ** level  # [L] a_i^d
    order = np.lexsort((level, seq, -gain / cost[seq]))  # by gain per token, then i, then d
    seq, gain = seq[order], gain[order]
    taken = _fitting(seq, cost, b.room)
    seq, gain = seq[taken], gain[taken]
    tokens = np.cumsum(cost[seq])
    emitted = np.cumsum(np.concatenate(([float(n)], gain)))
    drafting_s = (steps.decodes_s + steps.added_many(tokens)) + rounds_s
    step_s = np.concatenate(([steps.decodes_s], drafting_s))
    trial = emitted / step_s  # [J + 1] goodput of each prefix (0: no drafts)
    top = int(np.argmax(trial))
    within = _within(seq, gain, n, steps.mixed_s - steps.decodes_s + step_s, steps.tpot_limit_s)
    within[0] = True  # no drafts: the step as it is, whatever its TPOT
    best = int(np.argmax(np.where(within, trial, -np.inf)))
    return (
        _Plan(_ks(n, seq[:best]), float(trial[best])),
        _Plan(_ks(n, seq[:top]), float(trial[top])),
    )


def _fitting(
    seq: npt.NDArray[np.int64], cost: npt.NDArray[np.int64], room: int
) -> npt.NDArray[np.int64]:
    """Positions of ``seq`` taken while they fit ``room``; a sequence that misses drops out."""
    if room <= 0:
        return np.zeros(0, dtype=np.int64)
    if np.all(cost == cost[0]):
        return np.arange(min(seq.size, room // int(cost[0])))
    kept, dropped, tokens = [], set(), 0
    for j, i in enumerate(seq.tolist()):
        if i in dropped:
            continue
        c = int(cost[i])
        if tokens + c > room:
            dropped.add(i)
            continue
        kept.append(j)
        tokens += c
    return np.asarray(kept, dtype=np.int64)


def _within(
    seq: npt.NDArray[np.int64],
    gain: npt.NDArray[np.float64],
    n: int,
    step_s: npt.NDArray[np.float64],
    limit_s: float,
) -> npt.NDArray[np.bool_]:
    """[J + 1] whether each prefix's step ``step_s`` keeps every sequence's TPOT <= ``limit_s``."""
    if not np.isfinite(limit_s):
        return np.ones(step_s.shape, dtype=bool)
    fewest = np.ones(step_s.shape)
    first = np.full(n, seq.size + 1)
    np.minimum.at(first, seq, np.arange(1, seq.size + 1))
    everyone = int(first.max())
    if everyone <= seq.size:
        grid = np.zeros((seq.size + 1, n))
        grid[0] = 1.0
        grid[np.arange(1, seq.size + 1), seq] = gain
        expected = np.cumsum(grid, axis=0)
        fewest[everyone:] = expected[everyone:].min(axis=1)
    out: npt.NDArray[np.bool_] = step_s / fewest <= limit_s
    return out


def _ks(n: int, levels: npt.NDArray[np.int64]) -> list[int]:
    out: list[int] = np.bincount(levels, minlength=n).tolist()
    return out
