"""What a decode replica publishes to the router; batch aggregates (``E_i = E(alpha_i, k_i)``,
``speculation.goodput``) are computed here so they stay exact when lists are cut to MAX_LISTED."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from speculation.calibration import Cell, cells_from
from speculation.goodput import expected_tokens
from speculation.step_time import StepTimeModel

ROUTING_STATS_VERSION = 6
MAX_LISTED = 256


@dataclass(frozen=True)
class RoutingStats:
    time: float
    running: int
    queued: int
    free_blocks: int
    num_blocks: int
    block_size: int
    max_batch_size: int
    k_max: int
    step_tokens: int  # tokens the next step scores: sum over the batch of 1 + w_i * k_i
    tpot_weight: float  # sum over the batch of 1 / E(alpha_i, k_i)
    slowest_weight: float  # max over the batch of 1 / E(alpha_i, k_i) (0: empty)
    step_emitted: float
    adaptive: bool
    step_max_k: int
    draft_round_s: float  # measured cost of one draft round (0: drafting has no model forward)
    draft_token_s: float  # learned cost of one more draft token at this batch size (0: unknown)
    alphas: tuple[float, ...]
    ks: tuple[int, ...]
    step_time: tuple[tuple[int, float], ...]
    calibration: tuple[Cell, ...] = ()
    tree_width: int = 1
    cycle_overhead_s: float = 0.0  # the served loop's time a step beyond its forwards
    version: int = ROUTING_STATS_VERSION

    def to_dict(self) -> dict[str, Any]:
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
                cycle_overhead_s=float(d["cycle_overhead_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed routing stats: {e!r}") from e

    def step_time_model(self) -> StepTimeModel | None:
        return StepTimeModel(self.step_time) if self.step_time else None


@dataclass(frozen=True)
class ReplicaLoad:
    queued: int
    free_blocks: int
    num_blocks: int
    block_size: int
    max_batch_size: int


@dataclass(frozen=True)
class SpeculationState:
    k_max: int
    adaptive: bool
    step_time: StepTimeModel | None
    draft_round_s: float = 0.0
    draft_token_s: float = 0.0
    calibration: tuple[Cell, ...] = ()
    tree_width: int = 1
    cycle_overhead_s: float = 0.0


def collect_routing_stats(
    alphas: Sequence[float],
    ks: Sequence[int],
    load: ReplicaLoad,
    spec: SpeculationState,
    widths: Sequence[int] | None = None,
    now: float | None = None,
) -> RoutingStats:
    """Summarise a batch for the router (``widths``: draft-tree width per request; None: chains)."""
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
        cycle_overhead_s=spec.cycle_overhead_s,
    )
