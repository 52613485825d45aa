"""The goodput model, and the speculation lengths that make the most of a decode step.

One model serves the engine's adaptive speculation length, the acceptance-aware router and the
router simulator, so all three agree on what a replica can do:

- a sequence with per-token acceptance rate ``a`` that verifies ``k`` draft tokens (a step of
  width ``k + 1``) emits on average ``(1 - a^(k+1)) / (1 - a)`` tokens;
- a step costs ``StepTimeModel.predict(tokens)`` seconds (``speculation.step_time``), where
  ``tokens`` is what the target scores in one forward (every running sequence's ``1 + k``);
- goodput is emitted tokens per second: the sum of the first over the second.

``choose_ks`` grants each sequence the draft length that maximises the step's goodput, within
a token budget, the draft rounds a model drafter runs, and optionally a TPOT SLO.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from speculation.step_time import StepTimeModel

# the most of a step's goodput the TPOT guard gives up; past it, the drafts' throughput wins
GUARD_MAX_LOSS = 0.1


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens one step emits for a sequence verifying ``k`` drafts."""
    a = min(max(alpha, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def goodput(alphas: Sequence[float], ks: Sequence[int], model: StepTimeModel) -> float:
    """Emitted tokens per second of one step over the batch."""
    tokens = sum(1 + k for k in ks)
    if tokens == 0:
        return 0.0
    emitted = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
    return emitted / model.predict(tokens)


@dataclass(frozen=True)
class DraftBatch:
    """The sequences a step may draft for: what each is expected to accept and may draft."""

    alphas: Sequence[float]  # per sequence: acceptance estimate
    caps: int | Sequence[int]  # the most draft levels of every sequence, or of each
    widths: Sequence[int] | None = None  # tokens per draft level (a tree's width); None: 1
    pays_rounds: Sequence[bool] | None = None  # drafted by the model (runs rounds); None: all


@dataclass(frozen=True)
class StepCosts:
    """What a step costs beyond its sequences' own tokens.

    ``fixed_tokens`` are other tokens in the same forward (prompt chunks); ``token_budget``
    caps the drafted tokens plus one per sequence. ``per_draft_s``, when the replica has
    measured it (``speculation.draft_cost.DraftCost``), is a floor on what each draft token
    adds. ``round_s`` is one draft round of a model drafter (``DraftRounds``): a step drafting
    ``m`` levels deep pays ``m`` of them, beyond the ``paid_rounds`` that other sequences in the
    step run anyway.
    """

    model: StepTimeModel
    token_budget: int | None = None
    fixed_tokens: int = 0
    per_draft_s: float | None = None
    round_s: float = 0.0
    paid_rounds: int = 0


@dataclass(frozen=True)
class TpotGuard:
    """An operator's TPOT SLO for drafting (``slo_s`` None: none), and the most of a step's
    goodput keeping to it may cost (``max_loss``; 1: any)."""

    slo_s: float | None = None
    max_loss: float = GUARD_MAX_LOSS


NO_GUARD = TpotGuard()


def choose_ks(batch: DraftBatch, step: StepCosts, guard: TpotGuard = NO_GUARD) -> list[int]:
    """Speculation length per sequence that maximises the step's goodput.

    Each sequence's marginal gain from one more draft level, ``a^(k+1)``, only shrinks, so for
    a given number of tokens in the step the best drafts are the largest marginal gains per
    token overall. Taking them in that order, the goodput of every step size is evaluated and
    the best kept: exact even where the step time has steps of its own (GEMM tiles, wave
    quantization). Large batches make each extra token cost more, so speculation switches
    itself off there.

    Drafts must pay for themselves against the decodes' own goodput: the decodes are charged
    ``T(n)`` plus what the drafts add where the step really runs,
    ``T(n + fixed + drafts) - T(n + fixed)``; charging them the whole mixed step would make a
    long prompt chunk's step look slow and its drafts cheap beside it. With draft rounds, every
    depth the payers may reach is tried and the best kept.

    With ``guard.slo_s`` a step may draft only if every sequence's time per output token in it
    (the step's time over the tokens it expects to emit) stays within the SLO, or within the
    step without drafts where that is longer already, unless that gives up more than
    ``guard.max_loss`` of the step's goodput: then the drafts for throughput are taken. (Under
    open-loop load, throughput given up is time every request stays longer.)
    """
    n = len(batch.alphas)
    caps = [batch.caps] * n if isinstance(batch.caps, int) else list(batch.caps)
    if n == 0 or max(caps) <= 0:
        return [0] * n
    cost = [1] * n if batch.widths is None else list(batch.widths)
    full = sum(c * w for c, w in zip(caps, cost, strict=True))
    room = full if step.token_budget is None else min(full, step.token_budget - n)
    payer = [True] * n if batch.pays_rounds is None else list(batch.pays_rounds)
    plan = _Batch([min(max(a, 0.0), 1.0) for a in batch.alphas], caps, cost, payer, room)
    steps = _Steps.of(step.model, n, step.fixed_tokens, step.per_draft_s, guard.slo_s)
    kept, free = _best_plans(plan, step, steps)
    if guard.max_loss >= 1 or kept.goodput >= (1 - guard.max_loss) * free.goodput:
        return kept.ks
    return free.ks


@dataclass(frozen=True)
class _Batch:
    """``DraftBatch`` resolved: estimates clamped to [0, 1], every per-sequence list filled."""

    alphas: list[float]
    caps: list[int]
    cost: list[int]  # tokens per draft level
    payer: list[bool]
    room: int  # draft tokens the step may take


@dataclass(frozen=True)
class _Plan:
    """Speculation lengths for a step, and the goodput they give."""

    ks: list[int]
    goodput: float


def _best_plans(b: _Batch, step: StepCosts, steps: _Steps) -> tuple[_Plan, _Plan]:
    """``choose_ks``'s best plan that keeps to the SLO (``steps``), and its best plan for
    throughput alone (the same one without an SLO)."""
    if step.round_s <= 0:
        return _by_gain(b, steps, 0.0)
    # Rounds are paid per step, by the deepest drafting payer: for each depth D the payers may
    # reach, the best drafts cost tokens only (plus D rounds); the best D wins.
    top = max((c for c, p in zip(b.caps, b.payer, strict=True) if p), default=0)
    kept = free = _Plan([0] * len(b.alphas), -1.0)
    for depth in range(min(step.paid_rounds, top), top + 1):
        capped = [min(c, depth) if p else c for c, p in zip(b.caps, b.payer, strict=True)]
        rounds_s = step.round_s * max(depth - step.paid_rounds, 0)
        k, f = _by_gain(_Batch(b.alphas, capped, b.cost, b.payer, b.room), steps, rounds_s)
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


def _by_gain(b: _Batch, steps: _Steps, rounds_s: float) -> tuple[_Plan, _Plan]:
    """The drafts ``choose_ks`` takes by gain per token, with ``rounds_s`` of draft rounds
    charged to any step that drafts: the best prefix of that order that keeps to the SLO, and
    the best one overall (one pass finds both)."""
    alphas, caps, cost = b.alphas, b.caps, b.cost
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
        if tokens + cost[i] > b.room:
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
