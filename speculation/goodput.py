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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

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
    """``DraftBatch`` resolved: estimates clamped to [0, 1], every per-sequence list filled."""

    alphas: npt.NDArray[np.float64]  # [n] in [0, 1]
    caps: npt.NDArray[np.int64]  # [n] >= 0
    cost: npt.NDArray[np.int64]  # [n] tokens per draft level
    payer: npt.NDArray[np.bool_]  # [n] drafted by the model (runs its rounds)
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

    def added_many(self, drafts: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
        """[J] what each count of draft tokens adds to the decodes' step."""
        added = self.model.predict_many(self.n + self.fixed_tokens + drafts) - self.mixed_s
        if self.per_draft_s is None:
            return added
        out: npt.NDArray[np.float64] = np.maximum(added, self.per_draft_s * drafts)
        return out


def _by_gain(b: _Batch, steps: _Steps, rounds_s: float) -> tuple[_Plan, _Plan]:
    """The drafts ``choose_ks`` takes by gain per token, with ``rounds_s`` of draft rounds
    charged to any step that drafts: the best prefix of that order that keeps to the SLO, and
    the best one overall.

    Level ``d`` of sequence ``i`` gains ``a_i^d`` for ``cost_i`` tokens; gains fall with ``d``,
    so taking levels by gain per token is one sort of every (sequence, level), ties broken by
    sequence then level. A sequence whose next level does not fit the room left drops out, its
    deeper levels with it. Every prefix of the order is then priced at once.
    """
    n = len(b.alphas)
    caps = np.asarray(b.caps, dtype=np.int64)  # [n]
    cost = np.asarray(b.cost, dtype=np.int64)  # [n]
    alphas = np.asarray(b.alphas, dtype=np.float64)  # [n]
    seq = np.repeat(np.arange(n), np.maximum(caps, 0))  # [L] every (sequence, level)
    level = (
        np.arange(seq.size) - np.repeat(np.cumsum(caps.clip(0)) - caps.clip(0), caps.clip(0)) + 1
    )
    gain = alphas[seq] ** level  # [L] a_i^d
    order = np.lexsort((level, seq, -gain / cost[seq]))  # by gain per token, then i, then d
    seq, gain = seq[order], gain[order]
    taken = _fitting(seq, cost, b.room)  # [J] positions in the order that are taken
    seq, gain = seq[taken], gain[taken]
    tokens = np.cumsum(cost[seq])  # [J] draft tokens after each level
    emitted = np.cumsum(np.concatenate(([float(n)], gain)))  # [J + 1]
    drafting_s = (steps.decodes_s + steps.added_many(tokens)) + rounds_s  # [J]
    step_s = np.concatenate(([steps.decodes_s], drafting_s))  # [J + 1]
    trial = emitted / step_s  # [J + 1] goodput of each prefix (0: no drafts)
    top = int(np.argmax(trial))  # first of the best prefixes whatever the SLO
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
    """Positions of the ordered levels ``seq`` that fit ``room`` tokens: in order, a level is
    taken while it fits, and a sequence whose level does not fit is dropped for good."""
    if room <= 0:
        return np.zeros(0, dtype=np.int64)
    if np.all(cost == cost[0]):  # one width: the levels that fit are a prefix
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
    """[J + 1] whether every sequence's time per output token in a step of ``step_s`` (one per
    prefix of the taken levels ``seq``, gaining ``gain``) is at most ``limit_s``. A sequence
    expects one token plus its levels' gains; one not yet drafted, one."""
    if not np.isfinite(limit_s):
        return np.ones(step_s.shape, dtype=bool)
    fewest = np.ones(step_s.shape)  # [J + 1] the fewest tokens any sequence expects
    first = np.full(n, seq.size + 1)  # the prefix length at each sequence's first level
    np.minimum.at(first, seq, np.arange(1, seq.size + 1))
    everyone = int(first.max())  # the prefix from which every sequence has drafted
    if everyone <= seq.size:
        grid = np.zeros((seq.size + 1, n))  # [J + 1, n] each level's gain, by sequence
        grid[0] = 1.0  # every sequence expects its own token
        grid[np.arange(1, seq.size + 1), seq] = gain
        expected = np.cumsum(grid, axis=0)  # [J + 1, n]: 1 + its gains so far
        fewest[everyone:] = expected[everyone:].min(axis=1)
    out: npt.NDArray[np.bool_] = step_s / fewest <= limit_s
    return out


def _ks(n: int, levels: npt.NDArray[np.int64]) -> list[int]:
    """Speculation lengths from the sequences that took each draft level, in order."""
    out: list[int] = np.bincount(levels, minlength=n).tolist()
    return out
