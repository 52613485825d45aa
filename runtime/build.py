"""Building a worker's shard: in this process, or over a tensor-parallel group."""

from __future__ import annotations

import logging
from dataclasses import replace

from kvtransfer.path_check import PathProbe
from kvtransfer.select import make_transport
from runtime.kv_sizing import check_sizable, size_pool
from runtime.shard import (
    Shard,
    ShardSpec,
    load_draft,
    load_draft_model,
    load_target,
    rank_pool,
    target_runner,
)

log = logging.getLogger(__name__)


def build_shard(spec: ShardSpec) -> Shard:
    spec.configure_process()
    check_sizable(spec)
    if spec.tp_size > 1:
        # imported here: TP ranks are Ray actors; a one-process shard runs without Ray
        from runtime.tp_group import build_tp_shard

        return build_tp_shard(spec)
    model = load_target(spec)
    drafter = load_draft_model(spec)
    if spec.memory_utilization is not None:
        blocks = size_pool(spec, model, spec.profile_tokens, spec.profile_seqs, spec.profile_query)
        spec = replace(spec, num_blocks=blocks)
    pool = rank_pool(spec, 0)
    target = target_runner(spec, model, pool)
    draft = load_draft(spec, pool, drafter)
    fabric = spec.resolve_fabric()
    transport, why = make_transport(spec.transport, pool, spec.role, fabric=fabric)
    log.info("%s shard: %s", spec.role, target.describe())
    probe = None
    if spec.path_check and why is None:  # NIXL is up: measure where its reads really go
        probe = PathProbe(fabric, spec.device, spec.min_path_gbps, spec.role)
    return Shard(target, draft, pool, transport, 1, why, fabric=fabric, path=probe)
