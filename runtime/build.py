"""Building a worker's shard: in this process, or over a tensor-parallel group."""

from __future__ import annotations

import logging

from kvtransfer.select import make_transport
from runtime.shard import Shard, ShardSpec, load_draft, rank_pool, rank_target

log = logging.getLogger(__name__)


def build_shard(spec: ShardSpec) -> Shard:
    spec.configure_process()
    if spec.tp_size > 1:
        # imported here: TP ranks are Ray actors; a one-process shard runs without Ray
        from runtime.tp_group import build_tp_shard

        return build_tp_shard(spec)
    pool = rank_pool(spec, 0)
    target = rank_target(spec, pool)
    draft = load_draft(spec, pool)
    transport, why = make_transport(spec.transport, pool, spec.role)
    log.info("%s shard: %s", spec.role, target.describe())
    return Shard(target, draft, pool, transport, tp_size=1, fallback_reason=why)
