"""Each pool's replicas publish their health to a deployment-scoped board that /health reads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

log = logging.getLogger(__name__)

PUBLISH_PERIOD_S = 1.0
STALE_S = 10.0
PUBLISH_TIMEOUT_S = 5.0
BOARD = "health"


class Board:
    """One pool's latest stats per replica, timed on this process's monotonic clock."""

    def __init__(self, stale_s: float = STALE_S) -> None:
        self.stale_s = stale_s
        self._entries: dict[str, tuple[float, dict[str, Any]]] = {}

    def publish(self, replica: str, stats: dict[str, Any]) -> None:
        self._entries[replica] = (time.monotonic(), stats)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Replica id -> its stats and ``age_s``; stale entries are dropped."""
        now = time.monotonic()
        for rid in [r for r, (t, _) in self._entries.items() if now - t > self.stale_s]:
            del self._entries[rid]
        return {rid: {**s, "age_s": round(now - t, 3)} for rid, (t, s) in self._entries.items()}


HealthBoard = ray.remote(num_cpus=0)(Board)


def board_actor_config() -> Any:
    from ray.serve.config import DeploymentActorConfig

    return DeploymentActorConfig(name=BOARD, actor_class=HealthBoard, actor_options={"num_cpus": 0})


def pool_board() -> Any:
    """This replica's pool's board (looked up afresh: the controller may have recreated it)."""
    from ray import serve

    return serve.get_deployment_actor(BOARD)


class BoardPublisher:
    """Publishes ``collect()`` to the pool board every ``PUBLISH_PERIOD_S`` from a daemon thread."""

    def __init__(self, collect: Callable[[], dict[str, Any]]) -> None:
        from ray import serve

        self.replica = serve.get_replica_context().replica_tag
        self._collect = collect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-health", daemon=True)
        self._thread.start()

    @staticmethod
    def in_replica() -> bool:
        try:
            from ray import serve

            serve.get_replica_context()
        except Exception:
            return False
        return True

    @staticmethod
    def start(collect: Callable[[], dict[str, Any]]) -> BoardPublisher | None:
        return BoardPublisher(collect) if BoardPublisher.in_replica() else None

    def _run(self) -> None:
        board = None
        node = ray.get_runtime_context().get_node_id()
        while not self._stop.wait(PUBLISH_PERIOD_S if board is not None else 0.2):
            try:
                board = board or pool_board()
                # waited on, so a dead board is noticed and looked up again once recreated
                stats = {**self._collect(), "node_id": node}
                ray.get(board.publish.remote(self.replica, stats), timeout=PUBLISH_TIMEOUT_S)
            except Exception as e:  # board being (re)created, or the replica shutting down
                log.debug("health publish failed: %s", e)
                board = None

    def stop(self) -> None:
        self._stop.set()


@dataclass(frozen=True)
class PoolHealth:
    replicas: dict[str, dict[str, Any]]
    fallback_replicas: tuple[str, ...]  # KV transport not NIXL
    kv_recomputed: int
    kv_failed_fraction: float | None
    degraded: str | None
    acceptance_collapse: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "num_replicas": len(self.replicas),
            "fallback_replicas": list(self.fallback_replicas),
            "kv_recomputed": self.kv_recomputed,
            "kv_failed_fraction": self.kv_failed_fraction,
            "degraded": self.degraded,
            "acceptance_collapse": list(self.acceptance_collapse),
        }


SUMMARY = (
    "running",
    "waiting",
    "pulling",
    "free_blocks",
    "num_blocks",
    "kv_recomputed",
    "kv_handoffs",
    "kv_recent_handoffs",
    "kv_recent_failed",
    "quarantined_blocks",
    "transport",
    "transport_fallback",
    "kv_path",
    "preemptions",
    "stalled",
    "drafter",
    "acceptance_collapse",
    "drafter_version",
    "seeded_tokens",
    "active_leases",
    "leases_expired",
    "queued",
    "rss_bytes",
    "heap_releases",
    "onednn_cache_capacity",
    "switch_interval_s",
    "attention",
    "attention_fallbacks",
    "warm_up",
    "compiles_during_traffic",
    "captures_during_traffic",
    "matmul",
    "layers",
    "node_id",
    "age_s",
)


def pool_health(pool: str, entries: dict[str, dict[str, Any]], max_failed: float) -> PoolHealth:
    """Sum a pool's board entries; degraded past ``max_failed`` or on an acceptance collapse."""
    replicas = {rid: {k: s[k] for k in SUMMARY if k in s} for rid, s in sorted(entries.items())}
    fallback = tuple(rid for rid, s in replicas.items() if s.get("transport_fallback"))
    recent = sum(int(s.get("kv_recent_handoffs", 0)) for s in entries.values())
    failed = sum(int(s.get("kv_recent_failed", 0)) for s in entries.values())
    fraction = failed / recent if recent else None
    why = []
    if fraction is not None and fraction > max_failed:
        why.append(
            f"{pool}: {failed} of the last {recent} KV handoffs failed their pull "
            f"({fraction:.0%}, over kv.degraded_fraction {max_failed:.0%}); prompts are being "
            "recomputed on decode"
        )
    for rid, s in replicas.items():
        path = s.get("kv_path") or {}
        if path.get("degraded"):
            why.append(f"{pool}: replica {rid}: {path['degraded']}")
    collapsed = tuple(rid for rid, s in replicas.items() if s.get("acceptance_collapse"))
    if collapsed:
        rid = collapsed[0]
        c = replicas[rid]["acceptance_collapse"][0]
        why.append(
            f"{pool}: drafts' acceptance collapsed on {len(collapsed)} replica(s); {rid} "
            f"(drafter {replicas[rid].get('drafter')}): temperature bin {c['temperature_bin']}, "
            f"probe bin {c['probe_bin']} accepted {c['realised']:.0%} of draft tokens where "
            f"{c['expected']:.0%} was predicted; adaptive speculation backs off for those cells "
            "(decode.acceptance_alarm_ratio)"
        )
    return PoolHealth(
        replicas,
        fallback,
        sum(int(s.get("kv_recomputed", 0)) for s in entries.values()),
        fraction,
        "; ".join(why) or None,
        collapsed,
    )
