"""Acceptance priors shared across a decode pool: a replica that starts mid-traffic seeds its
calibration from the cells its siblings of the same drafter version published on the board."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import ray

from serving.health_board import pool_board
from speculation.calibration import CalibrationPool, Cell, cells_from

log = logging.getLogger(__name__)

SEED_TIMEOUT_S = 5.0


class SeedsPrior(Protocol):
    def seed(self, cells: Sequence[Cell]) -> float:
        """Start from ``cells``; returns the draft tokens seeded."""
        ...


def drafter_version(kind: str, draft_fingerprint: str | None, target_fingerprint: str) -> str:
    """A hash of the drafter kind, the draft's (None: none) and the target's fingerprints."""
    key = f"{kind}:{draft_fingerprint or '-'}:{target_fingerprint}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def pooled_cells(entries: Mapping[str, Mapping[str, Any]], version: str) -> tuple[Cell, ...]:
    pool = CalibrationPool()
    for row, entry in enumerate(entries.values()):
        if entry.get("drafter_version") == version and entry.get("calibration"):
            pool.put(row, cells_from(entry["calibration"]))
    return pool.cells()


def seed_from_pool(spec: SeedsPrior, version: str) -> float:
    """Seed ``spec`` from the pool's board (inside a Serve replica); returns the draft tokens
    seeded, 0 when the board has none of this version or cannot be read."""
    try:
        entries = ray.get(pool_board().snapshot.remote(), timeout=SEED_TIMEOUT_S)
    except Exception as e:
        log.warning(
            "acceptance priors: the pool's board could not be read (%s); starting "
            "from the default prior",
            e,
        )
        return 0.0
    cells = pooled_cells(entries, version)
    seeded = spec.seed(cells)
    log.info(
        "acceptance priors: seeded %d cells (%.0f draft tokens) from %d replicas of drafter "
        "version %s",
        len(cells),
        seeded,
        len(entries),
        version,
    )
    return seeded
