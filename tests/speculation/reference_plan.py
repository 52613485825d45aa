"""The planner ``speculation.goodput.choose_ks`` vectorised, as it was: one level at a time
from a heap, the step priced after each. The tests hold the vectorised planner to it exactly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from speculation.goodput import GUARD_MAX_LOSS
from speculation.step_time import StepTimeModel


def reference_choose_ks(
    alphas: Sequence[float],
    model: StepTimeModel,
    k_max: int | Sequence[int],
    token_budget: int | None = None,
    fixed_tokens: int = 0,
    per_draft_s: float | None = None,
    costs: Sequence[int] | None = None,
    round_s: float = 0.0,
    paid_rounds: int = 0,
    pays_rounds: Sequence[bool] | None = None,
    tpot_slo_s: float | None = None,
    tpot_slo_max_loss: float = GUARD_MAX_LOSS,
) -> list[int]:
    """The heap-based planner choose_ks replaced, kept as the oracle."""
    n = len(alphas)
    caps = [k_max] * n if isinstance(k_max, int) else list(k_max)
    if n == 0 or max(caps) <= 0:
        return [0] * n
    cost = [1] * n if costs is None else list(costs)
    full = sum(c * w for c, w in zip(caps, cost, strict=True))
    room = full if token_budget is None else min(full, token_budget - n)
    clamped = [min(max(a, 0.0), 1.0) for a in alphas]
    steps = _Steps.of(model, n, fixed_tokens, per_draft_s, tpot_slo_s)
    payer = [True] * n if pays_rounds is None else list(pays_rounds)
    kept, free = _best_plans(clamped, caps, cost, room, round_s, paid_rounds, payer, steps)
    if tpot_slo_max_loss >= 1 or kept.goodput >= (1 - tpot_slo_max_loss) * free.goodput:
        return kept.ks
    return free.ks


@dataclass(frozen=True)
class _Plan:
    """Speculation lengths for a step, and the goodput they give."""

    ks: list[int]
    goodput: float


def _best_plans(
    alphas: Sequence[float],
    caps: Sequence[int],
    cost: Sequence[int],
    room: int,
    round_s: float,
    paid_rounds: int,
    payer: Sequence[bool],
    steps: _Steps,
) -> tuple[_Plan, _Plan]:
    """``choose_ks``'s best plan that keeps to the SLO (``steps``), and its best plan for
    throughput alone (the same one without an SLO)."""
    if round_s <= 0:
        return _by_gain(alphas, caps, cost, room, steps, 0.0)
    # Rounds are paid per step, by the deepest drafting payer: for each depth D the payers may
    # reach, the best drafts cost tokens only (plus D rounds); the best D wins.
    top = max((c for c, p in zip(caps, payer, strict=True) if p), default=0)
    kept = free = _Plan([0] * len(alphas), -1.0)
    for depth in range(min(paid_rounds, top), top + 1):
        capped = [min(c, depth) if p else c for c, p in zip(caps, payer, strict=True)]
        rounds_s = round_s * max(depth - paid_rounds, 0)
        k, f = _by_gain(alphas, capped, cost, room, steps, rounds_s)
        kept = k if k.goodput > kept.goodput else kept
        free = f if f.goodput > free.goodput else free
    return kept, free


@dataclass(frozen=True)
class _Steps:
    """What a step costs ``choose_ks``: the decodes alone, and what drafts add to them."""

    model: StepTimeModel
    n: int  # sequences decoding
    fixed_tokens: int  # other tokens in the forward (prompt chunks)
    per_draft_s: float | None  # the measured floor on a draft token's cost
    decodes_s: float  # T(n)
    mixed_s: float  # T(n + fixed_tokens)
    tpot_limit_s: float  # what a drafting step's slowest TPOT may reach (inf: no SLO)

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

    def added(self, drafts: int) -> float:
        """What ``drafts`` draft tokens add to the decodes' step."""
        added = self.model.predict(self.n + self.fixed_tokens + drafts) - self.mixed_s
        return added if self.per_draft_s is None else max(added, self.per_draft_s * drafts)


def _by_gain(
    alphas: Sequence[float],
    caps: Sequence[int],
    cost: Sequence[int],
    room: int,
    steps: _Steps,
    rounds_s: float,
) -> tuple[_Plan, _Plan]:
    """The drafts ``choose_ks`` takes by gain per token, with ``rounds_s`` of draft rounds
    charged to any step that drafts: the best prefix of that order that keeps to the SLO, and
    the best one overall (one pass finds both)."""
    n = len(alphas)
    heap = [(-a / cost[i], i) for i, a in enumerate(alphas) if caps[i] > 0]  # gain per token
    heapq.heapify(heap)
    emitted = float(n)
    decodes = steps.decodes_s
    best, best_extra = emitted / decodes, 0
    top, top_extra = best, 0  # the best prefix whatever the SLO
    order: list[int] = []
    depth = [0] * n
    slowest = _Slowest(n, math.isfinite(steps.tpot_limit_s))
    tokens = 0  # draft tokens in the step so far
    while heap:
        _, i = heapq.heappop(heap)
        if tokens + cost[i] > room:
            continue  # its deeper levels cost as much: it is done
        order.append(i)
        depth[i] += 1
        tokens += cost[i]
        gain = alphas[i] ** depth[i]
        emitted += gain
        slowest.drafted(i, gain, depth[i] == 1)
        step_s = decodes + steps.added(tokens) + rounds_s
        trial = emitted / step_s
        if trial > top:
            top, top_extra = trial, len(order)
        if trial > best and slowest.within(steps.mixed_s - decodes + step_s, steps.tpot_limit_s):
            best, best_extra = trial, len(order)
        if depth[i] < caps[i]:
            heapq.heappush(heap, (-(alphas[i] ** (depth[i] + 1)) / cost[i], i))
    return _Plan(_ks(n, order[:best_extra]), best), _Plan(_ks(n, order[:top_extra]), top)


def _ks(n: int, levels: Sequence[int]) -> list[int]:
    """Speculation lengths from the sequences that took each draft level, in order."""
    ks = [0] * n
    for i in levels:
        ks[i] += 1
    return ks


class _Slowest:
    """The fewest tokens any sequence expects to emit in the step, as drafts are added one
    level at a time (a lazy min-heap; nothing is tracked when ``active`` is false)."""

    def __init__(self, n: int, active: bool) -> None:
        self.active = active
        self.undrafted = n  # sequences with no draft yet: each expects one token
        self.expected = [1.0] * n if active else []
        self.heap: list[tuple[float, int]] = []

    def drafted(self, i: int, gain: float, first: bool) -> None:
        """Sequence ``i`` took one more draft level (its ``first``), expecting ``gain`` more
        tokens."""
        if not self.active:
            return
        self.undrafted -= first
        self.expected[i] += gain
        heapq.heappush(self.heap, (self.expected[i], i))

    def within(self, step_s: float, limit_s: float) -> bool:
        """Whether every sequence's time per output token in a step of ``step_s`` is at most
        ``limit_s``."""
        if not self.active:
            return True
        if self.undrafted:
            return step_s <= limit_s
        while self.heap[0][0] != self.expected[self.heap[0][1]]:
            heapq.heappop(self.heap)  # an older level of a sequence drafted deeper since
        return step_s / self.heap[0][0] <= limit_s
