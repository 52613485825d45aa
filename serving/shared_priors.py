"""Acceptance priors shared across a decode pool: a replica that starts mid-traffic plans from
what its siblings have learned, not from the default.

Every decode replica publishes its acceptance calibration cells (``speculation.calibration``)
and its **drafter version** on the pool's health board (``serving.health_board``) with its other
stats. A new replica, once its engine is built, reads the board, sums the cells of the replicas
serving the same version and seeds its own calibration and prior from them
(``SpeculationPolicy.seed``). The version is the drafter kind and the weights of the draft and
of the target (``ModelSpec.fingerprint``): acceptance is a property of the pair, so a new head,
a new target revision or another drafter kind starts fresh. Routers already sum the live
replicas' cells from their routing stats (``CalibrationPool``), so they plan a new replica's
requests from the same numbers.

The replica's side (its config, its ``SpeculationPolicy``) is passed in: this module sits below
the deployments and imports none of them.
"""

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
    """What ``seed_from_pool`` seeds (a decode replica's ``SpeculationPolicy``)."""

    def seed(self, cells: Sequence[Cell]) -> float:
        """Start from ``cells``; returns the draft tokens seeded."""
        ...


def drafter_version(kind: str, draft_fingerprint: str | None, target_fingerprint: str) -> str:
    """What a replica's acceptance depends on: the drafter kind and the draft's (None: no draft
    model) and the target's weights (``ModelSpec.fingerprint``), as a short hash."""
    key = f"{kind}:{draft_fingerprint or '-'}:{target_fingerprint}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def pooled_cells(entries: Mapping[str, Mapping[str, Any]], version: str) -> tuple[Cell, ...]:
    """The summed calibration cells of the board entries that serve ``version``."""
    pool = CalibrationPool()
    for row, entry in enumerate(entries.values()):
        if entry.get("drafter_version") == version and entry.get("calibration"):
            pool.put(row, cells_from(entry["calibration"]))
    return pool.cells()


def seed_from_pool(spec: SeedsPrior, version: str) -> float:
    """Seed ``spec`` from the pool's board (inside a Serve replica); the draft tokens seeded,
    0 when the board has none of this version or cannot be read (logged: the replica then
    starts from the default prior, as a first replica does)."""
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
