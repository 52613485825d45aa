"""A decode replica's speculation policy, with the step-time model adaptive mode chooses k by.

The model is measured once per (target, dtype, device, TP size, threads, shapes) and cached
under ``~/.cache/tandem/steptime`` (``decode.step_time``), so replicas after the first start
without measuring; the policy then refines it from the steps it runs.
"""

from __future__ import annotations

import hashlib

import torch

from decode.config import DecodeEngineConfig
from decode.drafters.base import Drafter
from decode.speculation import SpeculationPolicy
from decode.step_time import METHOD, cached_step_time, calibration_points, measure_step_time
from kvtransfer.allocator import BlockAllocator
from models.runner import ModelRunner
from models.weights import default_cache_dir


def build_speculation(
    cfg: DecodeEngineConfig, drafter: Drafter, target: ModelRunner, allocator: BlockAllocator
) -> SpeculationPolicy:
    """Pinned k, or adaptive k over the replica's measured (or cached) step-time model."""
    d = cfg.draft
    held = drafter.step_dependent
    if not d.adaptive:
        return SpeculationPolicy(d.num_speculative_tokens, None, held, d.tree_width, drafter)
    shapes = calibration_points(
        min(cfg.max_batch_size, 32),
        d.num_speculative_tokens + 1,
        min(cfg.max_num_batched_tokens, 256),
    )
    t = cfg.target
    key = (
        f"v{METHOD}-{t.fingerprint()}-{t.dtype}-{cfg.device}-tp{cfg.tp_size}"
        f"-t{torch.get_num_threads()}-{shapes}"
    )
    path = (
        default_cache_dir() / "steptime" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
    )
    model = cached_step_time(
        path, lambda: measure_step_time(target, allocator, cfg.block_size, shapes)
    )
    return SpeculationPolicy(
        d.num_speculative_tokens,
        model,
        held,
        d.tree_width,
        drafter,
        cfg.speculation_tpot_slo_s,
        cfg.speculation_tpot_slo_max_loss,
    )
