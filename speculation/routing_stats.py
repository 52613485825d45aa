"""What a decode replica tells the router: its load, its speculation state, its step time.

A replica publishes this through Ray Serve's replica routing stats
(``DecodeServer.record_routing_stats`` returns ``to_dict()``); the router reads it back with
``RoutingStats.from_dict``. The two aggregates the router scores with are computed here, on the
replica, over every request in the batch, so they stay exact when the per-request lists are
cut to ``MAX_LISTED``:

- ``step_tokens``: tokens the next step scores, ``sum(1 + w_i * k_i)``, ``w_i`` the width of
  request i's draft tree (``draft.tree_width`` for a greedy request, else 1: a chain);
- ``tpot_weight``: ``sum(1 / E(alpha_i, k_i))`` with ``E`` from ``speculation.goodput``.
  Request i's time per output token is ``step_time / E_i``, so when the step time grows by
  ``d`` seconds the running requests' TPOTs grow by ``d * tpot_weight`` in sum;
- ``slowest_weight``: ``max(1 / E(alpha_i, k_i))``, so the slowest running request's TPOT is
  ``step_time * slowest_weight``: what a router that keeps requests within a TPOT SLO must not
  push over it (0 for an empty batch);
- ``step_emitted``: ``sum(E(alpha_i, k_i))``, the tokens a step emits: with the step time it
  gives the batch's goodput, hence the gain below which adaptive speculation grants no draft;
- ``step_max_k`` and ``draft_round_s``: a model drafter (an EAGLE head, a draft model)
  proposes in ``max_i k_i`` sequential rounds over the batch, each costing about
  ``draft_round_s`` whoever drafts in it, a per-step cost the tokens-only step-time model does
  not see (the replica times its rounds, ``speculation.draft_cost.DraftRounds``, and leaves
  them out of the step-time model it learns; 0 for n-gram lookup);
- ``draft_token_s``: what one more draft token adds to the target's step at this batch size,
  rounds apart, as the replica has learned it from its own steps (``DraftCost``; 0
  until it has). Adaptive speculation charges drafts at least that plus their share of the
  rounds; the router charges that and adds the rounds per step, so where rounds are dear it
  may predict a k above what the engine grants;
- ``tree_width``: tokens per draft level a greedy request would put in a step here (the
  width of its draft tree, ``draft.tree_width``; 1: chains), so the router prices a new greedy
  request's drafts as the replica will run them;
- ``calibration``: the replica's acceptance cells (``speculation.calibration``): what its finished
  requests accepted per temperature and probe bin. Routers sum them over replicas to turn a new
  request's probe into the estimate its engine will start it from.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from speculation.calibration import Cell, cells_from
from speculation.goodput import expected_tokens
from speculation.step_time import StepTimeModel

ROUTING_STATS_VERSION = 5
MAX_LISTED = 256  # per-request acceptance estimates and ks published at most


@dataclass(frozen=True)
class RoutingStats:
    """One decode replica's state as the router sees it (``time`` is the replica's clock)."""

    time: float  # unix time the snapshot was taken
    running: int  # requests in the continuous batch (their KV is resident)
    queued: int  # waiting for KV blocks or a pull, or running beyond max_batch_size
    free_blocks: int
    num_blocks: int
    block_size: int
    max_batch_size: int
    k_max: int  # most draft tokens a request verifies per step (0: no speculation)
    step_tokens: int  # tokens the next step scores: sum over the batch of 1 + w_i * k_i
    tpot_weight: float  # sum over the batch of 1 / E(alpha_i, k_i)
    slowest_weight: float  # max over the batch of 1 / E(alpha_i, k_i) (0: empty)
    step_emitted: float  # sum over the batch of E(alpha_i, k_i)
    adaptive: bool  # k chosen per request for goodput (speculation.goodput.choose_ks), else pinned
    step_max_k: int  # the longest speculation in the batch: draft rounds per step
    draft_round_s: float  # measured cost of one draft round (0: drafting has no model forward)
    draft_token_s: float  # learned cost of one more draft token at this batch size (0: unknown)
    alphas: tuple[float, ...]  # acceptance estimates of (up to MAX_LISTED) batch requests
    ks: tuple[int, ...]  # their current speculation lengths
    step_time: tuple[tuple[int, float], ...]  # the replica's StepTimeModel points; () if none
    calibration: tuple[Cell, ...] = ()  # acceptance realised per (temperature, probe) cell
    tree_width: int = 1  # tokens per draft level of a greedy request (draft.tree_width)
    version: int = ROUTING_STATS_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain types only: this crosses Ray's controller to every router."""
        d = asdict(self)
        d["alphas"] = [round(a, 4) for a in self.alphas]
        d["ks"] = list(self.ks)
        d["step_time"] = [[n, t] for n, t in self.step_time]
        d["calibration"] = [
            [c.temperature_bin, c.probe_bin, round(c.drafted, 2), round(c.accepted, 2)]
            for c in self.calibration
        ]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoutingStats:
        """Parse a published dict; ``ValueError`` if it is missing fields or of another version."""
        if d.get("version") != ROUTING_STATS_VERSION:
            raise ValueError(f"routing stats version {d.get('version')!r} is not supported")
        try:
            return cls(
                time=float(d["time"]),
                running=int(d["running"]),
                queued=int(d["queued"]),
                free_blocks=int(d["free_blocks"]),
                num_blocks=int(d["num_blocks"]),
                block_size=int(d["block_size"]),
                max_batch_size=int(d["max_batch_size"]),
                k_max=int(d["k_max"]),
                step_tokens=int(d["step_tokens"]),
                tpot_weight=float(d["tpot_weight"]),
                slowest_weight=float(d["slowest_weight"]),
                step_emitted=float(d["step_emitted"]),
                adaptive=bool(d["adaptive"]),
                step_max_k=int(d["step_max_k"]),
                draft_round_s=float(d["draft_round_s"]),
                draft_token_s=float(d["draft_token_s"]),
                alphas=tuple(float(a) for a in d["alphas"]),
                ks=tuple(int(k) for k in d["ks"]),
                step_time=tuple((int(n), float(t)) for n, t in d["step_time"]),
                calibration=cells_from(d["calibration"]),
                tree_width=int(d["tree_width"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed routing stats: {e!r}") from e

    def step_time_model(self) -> StepTimeModel | None:
        return StepTimeModel(self.step_time) if self.step_time else None


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's capacity and what waits for it."""

    queued: int  # waiting for KV blocks or a pull, or running beyond max_batch_size
    free_blocks: int
    num_blocks: int
    block_size: int
    max_batch_size: int


@dataclass(frozen=True)
class SpeculationState:
    """A replica's speculation settings and what it has learned (``RoutingStats`` fields)."""

    k_max: int
    adaptive: bool
    step_time: StepTimeModel | None
    draft_round_s: float = 0.0
    draft_token_s: float = 0.0
    calibration: tuple[Cell, ...] = ()
    tree_width: int = 1  # what a new greedy request's draft-tree width would be


def collect_routing_stats(
    alphas: Sequence[float],
    ks: Sequence[int],
    load: ReplicaLoad,
    spec: SpeculationState,
    widths: Sequence[int] | None = None,
    now: float | None = None,
) -> RoutingStats:
    """Summarise a batch (one acceptance estimate, one k and one draft-tree width per request;
    ``widths`` None: chains) for the router."""
    w = [1] * len(ks) if widths is None else widths
    emitted = [expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True)]
    return RoutingStats(
        time=time.time() if now is None else now,
        running=len(alphas),
        queued=load.queued,
        free_blocks=load.free_blocks,
        num_blocks=load.num_blocks,
        block_size=load.block_size,
        max_batch_size=load.max_batch_size,
        k_max=spec.k_max,
        step_tokens=sum(1 + wi * k for wi, k in zip(w, ks, strict=True)),
        tpot_weight=sum(1.0 / e for e in emitted),
        slowest_weight=max((1.0 / e for e in emitted), default=0.0),
        step_emitted=sum(emitted),
        adaptive=spec.adaptive,
        step_max_k=max(ks, default=0),
        draft_round_s=spec.draft_round_s,
        draft_token_s=spec.draft_token_s,
        alphas=tuple(alphas[:MAX_LISTED]),
        ks=tuple(ks[:MAX_LISTED]),
        step_time=spec.step_time.points if spec.step_time is not None else (),
        calibration=spec.calibration,
        tree_width=spec.tree_width,
    )
