from __future__ import annotations

import pytest

from kvtransfer.resharding import HeadRun, head_runs, readers


def test_head_runs_cover_every_head_once() -> None:
    for src_tp, dst_tp in ((1, 2), (2, 1), (2, 4), (4, 2), (3, 3), (1, 1)):
        heads = 12
        seen: list[int] = []
        for d in range(dst_tp):
            for run in head_runs(d, dst_tp, src_tp, heads):
                src_global = run.src_rank * heads // src_tp + run.src_head
                dst_global = d * heads // dst_tp + run.dst_head
                assert src_global == dst_global  # the same head on both sides
                seen.extend(range(dst_global, dst_global + run.count))
        assert sorted(seen) == list(range(heads))


def test_readers_and_regions() -> None:
    assert head_runs(0, 1, 2, 4) == [HeadRun(0, 0, 0, 2), HeadRun(1, 0, 2, 2)]
    assert head_runs(1, 2, 1, 4) == [HeadRun(0, 2, 0, 2)]
    assert readers(0, 1, 2, 4) == 2 and readers(1, 2, 1, 4) == 1
    with pytest.raises(ValueError, match="cannot be split"):
        head_runs(0, 3, 1, 4)
