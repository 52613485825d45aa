"""The router's view of a decode replica (``speculation.routing_stats``)."""

from __future__ import annotations

from collections.abc import Sequence

from decode.config import DecodeEngineConfig
from decode.drafters.base import Drafter
from decode.speculation import SpeculationPolicy
from models.request import Request
from speculation.calibration import DEFAULT_ACCEPTANCE
from speculation.routing_stats import (
    ReplicaLoad,
    RoutingStats,
    SpeculationState,
    collect_routing_stats,
)


def routing_stats(
    cfg: DecodeEngineConfig,
    running: Sequence[Request],
    queued: int,
    free_blocks: int,
    spec: SpeculationPolicy | None,
    drafter: Drafter | None,
    cycle_overhead_s: float = 0.0,
) -> RoutingStats:
    """``queued``: requests waiting or pulling KV."""
    batch = running[: cfg.max_batch_size]
    load = ReplicaLoad(
        queued=queued + len(running) - len(batch),
        free_blocks=free_blocks,
        num_blocks=cfg.num_blocks,
        block_size=cfg.block_size,
        max_batch_size=cfg.max_batch_size,
    )
    if spec is None:
        state = SpeculationState(k_max=0, adaptive=False, step_time=None)
        return collect_routing_stats(
            [DEFAULT_ACCEPTANCE] * len(batch), [0] * len(batch), load, state
        )
    ks = spec.choose(batch, [spec.k_max] * len(batch), 0, cfg.max_num_batched_tokens)
    rounds = drafter.rounds if drafter is not None else None
    state = SpeculationState(
        k_max=spec.k_max,
        adaptive=spec.adaptive,
        step_time=spec.step_time,
        draft_round_s=rounds.round_s if rounds is not None else 0.0,
        draft_token_s=spec.draft_cost.per_draft(len(batch) + 1) or 0.0,
        calibration=spec.calibration.cells(),
        tree_width=spec.tree_width,
        cycle_overhead_s=cycle_overhead_s,
    )
    alphas = [spec.estimate(r) for r in batch]
    return collect_routing_stats(alphas, ks, load, state, [spec.draft_width(r) for r in batch])
