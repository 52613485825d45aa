"""What placing one request on a decode replica costs, by the goodput model
(``speculation.goodput``); the derivation is in docs/structure.md."""

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
    k: int  # the speculation length the replica's engine would grant it
    tpot_s: float
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
    """A replica's next step as a router scores it (the table's ``eff_*`` columns)."""

    step_tokens: int
    tpot_weight: float  # sum over the batch of 1 / E(alpha_i, k_i)
    step_emitted: float
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
        deeper = r.step_emitted / target * r.draft_round_s
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
    """A step-time model tabulated at integer token counts below ``size`` (array lookups when
    scoring every replica); the model itself beyond."""

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
    k: IntArray  # [D] the speculation length each replica's engine would grant it
    step_s: FloatArray  # [D] the replica's step time with it
    base_s: FloatArray  # [D] the replica's step time without it
    expected: FloatArray  # [D] tokens it emits per step there, E(alpha, k)
    cost_s: FloatArray  # [D] its TPOT there plus SLOWDOWN_WEIGHT times the others' rise

    @property
    def tpot_s(self) -> FloatArray:
        out: FloatArray = self.step_s / self.expected
        return out


@dataclass(frozen=True)
class ReplicaSteps:
    """``ReplicaStep`` over D replicas: every column is [D]."""

    step_tokens: FloatArray
    tpot_weight: FloatArray
    step_emitted: FloatArray
    adaptive: npt.NDArray[np.bool_]
    step_max_k: FloatArray
    draft_round_s: FloatArray
    draft_token_s: FloatArray | None = None  # None: unknown everywhere


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
