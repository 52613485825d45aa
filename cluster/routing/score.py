"""What placing one request on a decode replica costs, by the goodput model
(``speculation.goodput``).

A replica's next step scores ``t`` tokens, takes ``T(t)`` seconds and emits ``G`` tokens; its
running requests have TPOT weight ``W = sum_i 1 / E(alpha_i, k_i)`` (``speculation.routing_stats``).
A request of acceptance ``alpha`` placed there:

- gets the speculation length the replica's engine would grant it. Adaptive speculation
  (``choose_ks``) admits a draft level while its expected gain ``alpha^m`` beats what the
  level's ``w`` tokens cost at the batch's goodput, ``w * theta`` with
  ``theta = (G / T) * max(T(t + 1) - T(t), c)``, where ``c`` is what a draft token costs there
  as the replica has measured it (``DraftCost``; 0 until it has) and ``w`` the width of
  the request's draft there: the replica's ``tree_width`` for a greedy request, else 1 (a
  chain); a level deeper than the batch's longest speculation ``m`` also costs a draft round
  ``r`` (below), ``(G / T) * r`` more; so
  ``k = #{j <= k_max : alpha^j > w * theta + [j > m] * (G / T) * r}``. A pinned engine gives
  ``k_max``;
- makes the step take
  ``T' = T(t + 1) + max(T(t + 1 + w k) - T(t + 1), c * w k) + r * max(m, k)``
  (from ``T(t) + r * m``), where ``m`` is the longest speculation in the batch and ``r`` the
  cost of one draft round: a model drafter proposes in ``max k`` sequential rounds (a tree in
  one round per level), paid by every request in the step;
- has time per output token ``T' / E(alpha, k)``;
- raises the running requests' TPOTs by ``(T' - T) * W`` in sum (their ks held fixed);
- **costs** ``T' / E + SLOWDOWN_WEIGHT * (T' - T) * W``. The slowdown lasts as long as the
  request stays, and over its stay it meets the requests running now and, with arrivals
  steady and stays alike, about as many again that join meanwhile (a request's stay overlaps
  ``n + lambda * stay = 2n`` others on average): hence a weight of 2 on the rise summed over
  the requests running now.

Minimising that rise keeps apart requests whose costs multiply. A high-acceptance request takes
many drafts; its extra tokens and draft rounds slow every request there in proportion to ``W``,
which low-acceptance requests (``E`` near 1) make large. A low-acceptance request gains nothing
from drafts and pays the rounds of others', so it is best where the step is short and nobody
drafts long. Replicas therefore drift towards batches of like acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from speculation.goodput import expected_tokens
from speculation.step_time import StepTimeModel

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
SLOWDOWN_WEIGHT = 2.0  # the running requests now, and as many again joining during the stay


@dataclass(frozen=True)
class Placement:
    """The request's predicted fate on one replica."""

    k: int  # the speculation length the replica's engine would grant it
    tpot_s: float  # the request's time per output token there
    slowdown_s: float  # the rise in the running requests' TPOTs, summed
    cost_s: float  # tpot_s + SLOWDOWN_WEIGHT * slowdown_s


def expected_table(alpha: float, k_max: int) -> FloatArray:
    """``E(alpha, k)`` for k = 0 .. k_max."""
    return np.array([expected_tokens(alpha, k) for k in range(k_max + 1)], dtype=np.float64)


def granted_k(alpha: float, k_max: int, theta: FloatArray) -> IntArray:
    """Drafts adaptive speculation grants: every m <= k_max with ``alpha^m > theta``."""
    a = min(max(alpha, 1e-9), 1.0 - 1e-9)
    with np.errstate(divide="ignore"):
        m = np.ceil(np.log(np.clip(theta, 1e-300, None)) / np.log(a)) - 1  # alpha^m > theta
    k: IntArray = np.clip(m, 0, k_max).astype(np.int64)
    return k


@dataclass(frozen=True)
class ReplicaStep:
    """A replica's next step as a router scores it: its ``RoutingStats`` aggregates plus what
    the router sent it since (the table's ``eff_*`` columns)."""

    step_tokens: int  # tokens the step scores
    tpot_weight: float  # sum over the batch of 1 / E(alpha_i, k_i)
    step_emitted: float  # tokens the step emits
    adaptive: bool  # the engine chooses k per request (else it pins k_max)
    step_max_k: int  # the longest speculation in the batch: draft rounds per step
    draft_round_s: float  # one draft round (0: no model drafter)
    draft_token_s: float = 0.0  # the replica's learned cost of a draft token (0: unknown)


def placement(
    alpha: float, k_max: int, r: ReplicaStep, model: StepTimeModel | StepTable, width: int = 1
) -> Placement:
    """The cost of placing a request of acceptance ``alpha`` on one replica (scalar form);
    ``width``: tokens per draft level of the request there (its tree's width, else 1)."""
    target = model.predict(r.step_tokens)
    joined = model.predict(r.step_tokens + 1)
    k = k_max
    if r.adaptive:
        theta = width * r.step_emitted / target * max(joined - target, r.draft_token_s)
        deeper = r.step_emitted / target * r.draft_round_s  # a level beyond step_max_k: a round
        k = sum(  # alpha^m falls with m, the threshold rises: a prefix of the levels
            1 for m in range(1, k_max + 1) if alpha**m > theta + (deeper if m > r.step_max_k else 0)
        )
    base = target + r.draft_round_s * r.step_max_k
    drafts = max(model.predict(r.step_tokens + 1 + width * k) - joined, r.draft_token_s * width * k)
    step = joined + drafts + r.draft_round_s * max(r.step_max_k, k)
    tpot = step / expected_tokens(alpha, k)
    slow = (step - base) * r.tpot_weight
    return Placement(k, tpot, slow, tpot + SLOWDOWN_WEIGHT * slow)


@dataclass(frozen=True, eq=False)
class StepTable:
    """A step-time model tabulated at every integer token count below ``size`` (steps score
    whole tokens), so scoring every replica is array lookups; beyond, the model itself."""

    model: StepTimeModel
    seconds: FloatArray  # [size]

    @classmethod
    def of(cls, model: StepTimeModel, size: int = 16384) -> StepTable:
        return cls(model, model.predict_many(np.arange(size)))

    def at(self, tokens: IntArray) -> FloatArray:
        if tokens.size and tokens.max() >= self.seconds.size:
            return self.model.predict_many(tokens)
        out: FloatArray = self.seconds[tokens]
        return out

    def predict(self, tokens: int) -> float:
        if tokens < self.seconds.size:
            return float(self.seconds[tokens])
        return self.model.predict(tokens)


@dataclass(frozen=True)
class Outlook:
    """A request's predicted fate on many replicas at once (one entry per replica)."""

    k: IntArray  # [D] the speculation length each replica's engine would grant it
    step_s: FloatArray  # [D] the replica's step time with it
    base_s: FloatArray  # [D] the replica's step time without it
    expected: FloatArray  # [D] tokens it emits per step there, E(alpha, k)
    cost_s: FloatArray  # [D] its TPOT there plus SLOWDOWN_WEIGHT times the others' rise

    @property
    def tpot_s(self) -> FloatArray:
        """[D] the request's own time per output token there."""
        out: FloatArray = self.step_s / self.expected
        return out


@dataclass(frozen=True)
class ReplicaSteps:
    """``ReplicaStep`` over many replicas at once (one entry per replica)."""

    step_tokens: FloatArray  # [D]
    tpot_weight: FloatArray  # [D]
    step_emitted: FloatArray  # [D]
    adaptive: npt.NDArray[np.bool_]  # [D]
    step_max_k: FloatArray  # [D]
    draft_round_s: FloatArray  # [D]
    draft_token_s: FloatArray | None = None  # [D]; None: unknown everywhere


def placement_outlook(
    alpha: float, k_max: int, r: ReplicaSteps, steps: StepTable, width: FloatArray | None = None
) -> Outlook:
    """``placement(...)`` over many replicas sharing one step-time model, at once; ``width``:
    [D] tokens per draft level of the request on each (None: 1)."""
    t = r.step_tokens.astype(np.int64)  # [D]
    target = steps.at(t)
    joined = steps.at(t + 1)
    c = np.zeros_like(target) if r.draft_token_s is None else r.draft_token_s  # [D]
    w = np.ones(t.shape, dtype=np.int64) if width is None else width.astype(np.int64)  # [D]
    theta = w * r.step_emitted / target * np.maximum(joined - target, c)
    shallow = granted_k(alpha, k_max, theta)  # levels that need no round of their own
    m = r.step_max_k.astype(np.int64)
    deep = granted_k(alpha, k_max, theta + r.step_emitted / target * r.draft_round_s)
    k = np.where(r.adaptive, np.where(shallow <= m, shallow, np.maximum(m, deep)), k_max)
    base = target + r.draft_round_s * r.step_max_k
    drafts = np.maximum(steps.at(t + 1 + w * k) - joined, c * w * k)
    step = joined + drafts + r.draft_round_s * np.maximum(r.step_max_k, k)
    slow = (step - base) * r.tpot_weight
    e = expected_table(alpha, k_max)[k]
    return Outlook(k, step, base, e, step / e + SLOWDOWN_WEIGHT * slow)
