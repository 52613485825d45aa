"""A pool's health from every replica's published stats: stale replicas drop out, fallbacks are
listed, and a pool whose recent handoffs fail past the configured share is degraded."""

from __future__ import annotations

import time
from typing import Any

from serving.health_board import Board, pool_health


def _replica(recent: int, failed: int, fallback: str | None = None) -> dict[str, Any]:
    return {
        "running": 1,
        "kv_recomputed": failed,
        "kv_recent_handoffs": recent,
        "kv_recent_failed": failed,
        "transport": "object_store" if fallback else "nixl",
        "transport_fallback": fallback,
    }


def test_a_replica_that_stops_publishing_drops_out() -> None:
    board = Board(stale_s=0.2)
    board.publish("a", {"running": 1})
    board.publish("b", {"running": 2})
    time.sleep(0.3)
    board.publish("b", {"running": 3})
    snap = board.snapshot()
    assert set(snap) == {"b"} and snap["b"]["running"] == 3 and snap["b"]["age_s"] < 0.2


def test_the_failed_share_is_over_all_replicas_and_the_limit_is_exclusive() -> None:
    entries = {"a": _replica(10, 0), "b": _replica(10, 4)}  # 4 of 20: 20 %
    at = pool_health("decode", entries, 0.2)
    assert at.kv_failed_fraction == 0.2 and at.degraded is None and at.kv_recomputed == 4
    over = pool_health("decode", {**entries, "c": _replica(5, 3)}, 0.2)  # 7 of 25
    assert over.degraded is not None
    assert "7 of the last 25" in over.degraded and "kv.degraded_fraction" in over.degraded
    assert over.to_dict()["num_replicas"] == 3


def test_fallback_replicas_are_named_and_no_handoffs_is_not_degraded() -> None:
    entries = {"a": _replica(0, 0), "b": _replica(0, 0, fallback="NIXL unavailable: x")}
    h = pool_health("decode", entries, 0.0)
    assert h.fallback_replicas == ("b",) and h.kv_failed_fraction is None and h.degraded is None
    assert h.replicas["b"]["transport"] == "object_store"
