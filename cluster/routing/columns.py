"""The router's replica table columns, one float per row: the snapshot (``STATS``), what this
router sent since (``OVERLAY``), and their sum that policies read (``EFFECTIVE``)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

STATS = (
    "running", "queued", "step_tokens", "tpot_weight", "slowest_weight", "step_emitted",
    "adaptive", "step_max_k", "draft_round_s", "draft_token_s", "free_blocks", "num_blocks",
    "block_size", "max_batch", "k_max", "tree_width", "stats_time", "received_at",
)  # fmt: skip
OVERLAY = (
    "o_running", "o_queued", "o_tokens", "o_weight", "o_slowest", "o_emitted", "o_max_k",
    "o_blocks",
)  # fmt: skip
EFFECTIVE = (
    "eff_tokens", "eff_weight", "eff_slowest", "eff_emitted", "eff_max_k", "eff_slots",
    "eff_free",
)  # fmt: skip


class Columns:
    """Typed views of the columns (``ReplicaTable`` creates them with ``setattr``)."""

    running: FloatArray
    queued: FloatArray
    step_tokens: FloatArray
    tpot_weight: FloatArray
    slowest_weight: FloatArray  # the largest 1 / E_i in the batch (0: empty)
    step_emitted: FloatArray
    adaptive: FloatArray  # 1.0 where the replica chooses k per request, 0.0 where pinned
    step_max_k: FloatArray
    draft_round_s: FloatArray
    draft_token_s: FloatArray  # the replica's learned cost of a draft token (0: not yet)
    free_blocks: FloatArray
    num_blocks: FloatArray
    block_size: FloatArray
    max_batch: FloatArray
    k_max: FloatArray
    tree_width: FloatArray  # tokens per draft level of a greedy request (0 or 1: chains)
    stats_time: FloatArray
    received_at: FloatArray
    o_running: FloatArray
    o_queued: FloatArray
    o_tokens: FloatArray
    o_weight: FloatArray
    o_slowest: FloatArray  # largest 1 / E (and o_max_k: k) of entries that joined the batch
    o_emitted: FloatArray
    o_max_k: FloatArray
    o_blocks: FloatArray
    eff_tokens: FloatArray
    eff_weight: FloatArray
    eff_slowest: FloatArray  # the slowest request's TPOT per second of step time
    eff_emitted: FloatArray
    eff_max_k: FloatArray  # draft rounds per step
    eff_slots: FloatArray  # batch slots left after the queue
    eff_free: FloatArray
