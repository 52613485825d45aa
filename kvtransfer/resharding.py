"""Which KV heads each destination rank reads from which source rank (prefill TP != decode TP).

KV heads are split over TP ranks in contiguous ranges: with ``tp`` ranks and ``H`` heads, rank
``r`` holds global heads ``[r * H / tp, (r + 1) * H / tp)``. A destination rank reads, from
every source rank whose range overlaps its own, exactly the heads they share. In the pool
layout (``kvtransfer.pool``) the heads of each (layer, block, K/V) are adjacent, so a head run
is one contiguous range of every K part and every V part on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRun:
    src_rank: int
    src_head: int  # first local head on the source rank
    dst_head: int  # first local head on the destination rank
    count: int


def _split(num_heads: int, tp: int) -> int:
    if num_heads % tp:
        raise ValueError(f"{num_heads} KV heads cannot be split over TP={tp}")
    return num_heads // tp


def head_runs(dst_rank: int, dst_tp: int, src_tp: int, num_heads: int) -> list[HeadRun]:
    """The runs of heads destination rank ``dst_rank`` reads, one per overlapping source rank."""
    hd, hs = _split(num_heads, dst_tp), _split(num_heads, src_tp)
    lo, hi = dst_rank * hd, (dst_rank + 1) * hd
    runs = []
    for s in range(src_tp):
        a, b = max(lo, s * hs), min(hi, (s + 1) * hs)
        if a < b:
            runs.append(HeadRun(s, a - s * hs, a - lo, b - a))
    return runs


def readers(src_rank: int, src_tp: int, dst_tp: int, num_heads: int) -> int:
    """How many destination ranks read from source rank ``src_rank``."""
    return sum(
        any(run.src_rank == src_rank for run in head_runs(d, dst_tp, src_tp, num_heads))
        for d in range(dst_tp)
    )
