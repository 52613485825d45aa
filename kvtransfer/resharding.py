from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRun:
    src_rank: int
    src_head: int
    dst_head: int
    count: int


def _split(num_heads: int, tp: int) -> int:
    if num_heads % tp:
        raise ValueError(f"{num_heads} KV heads cannot be split over TP={tp}")
    return num_heads // tp


def head_runs(dst_rank: int, dst_tp: int, src_tp: int, num_heads: int) -> list[HeadRun]:
    hd, hs = _split(num_heads, dst_tp), _split(num_heads, src_tp)
    lo, hi = dst_rank * hd, (dst_rank + 1) * hd
    runs = []
    for s in range(src_tp):
        a, b = max(lo, s * hs), min(hi, (s + 1) * hs)
        if a < b:
            runs.append(HeadRun(s, a - s * hs, a - lo, b - a))
    return runs


def readers(src_rank: int, src_tp: int, dst_tp: int, num_heads: int) -> int:
    return sum(
        any(run.src_rank == src_rank for run in head_runs(d, dst_tp, src_tp, num_heads))
        for d in range(dst_tp)
    )
