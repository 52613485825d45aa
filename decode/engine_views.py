"""Read-only views of a decode engine: its counters (``EngineStats``) and the router's view of
the replica (``RoutingStats``). Both only copy, so another thread may take them while the
engine's thread steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from decode.outputs import EngineStats
from decode.routing_stats import RoutingStats, collect_routing_stats
from decode.speculation import DEFAULT_ACCEPTANCE

if TYPE_CHECKING:
    from decode.engine import DecodeEngine


def engine_stats(e: DecodeEngine) -> EngineStats:
    return EngineStats(
        num_blocks=e.cfg.num_blocks,
        free_blocks=e.allocator.num_free,
        waiting=len(e.waiting),
        pulling=len(e.intake.pending),
        running=len(e.running),
        target_tokens_fed=e.target_tokens_fed,
        draft_tokens_fed=e.drafter.tokens_fed if e.drafter else 0,
        steps=e.steps,
        preemptions=e.preemptions,
        kv_recomputed=e.recomputed,
    )


def routing_view(e: DecodeEngine) -> RoutingStats:
    """Load, each batched request's acceptance estimate and the k the speculation policy would
    give it now, the measured step-time model, draft-token and draft-round costs, and the
    acceptance calibration learned from finished requests."""
    running = tuple(e.running.values())
    batch = running[: e.cfg.max_batch_size]
    spec = e.speculation
    budget = e.cfg.max_num_batched_tokens
    ks = spec.choose(batch, [spec.k_max] * len(batch), 0, budget) if spec else [0] * len(batch)
    return collect_routing_stats(
        [spec.estimate(r) if spec else DEFAULT_ACCEPTANCE for r in batch],
        ks,
        queued=len(e.waiting) + len(e.intake.pending) + len(running) - len(batch),
        free_blocks=e.allocator.num_free,
        num_blocks=e.cfg.num_blocks,
        block_size=e.cfg.block_size,
        max_batch_size=e.cfg.max_batch_size,
        k_max=spec.k_max if spec else 0,
        adaptive=spec.adaptive if spec else False,
        step_time=spec.step_time if spec else None,
        draft_round_s=e.drafter.rounds.round_s if e.drafter and e.drafter.rounds else 0.0,
        draft_token_s=(spec.draft_cost.per_draft(len(batch) + 1) or 0.0) if spec else 0.0,
        calibration=spec.calibration.cells() if spec else (),
        widths=[spec.draft_width(r) for r in batch] if spec else None,
        tree_width=spec.tree_width if spec else 1,
    )
