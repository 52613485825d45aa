"""Every benchmark config under bench/configs is a valid TandemConfig (they are only read when
a benchmark launches a cluster, so a stale field would otherwise surface there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import TandemConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "bench" / "configs").glob("*.yaml"))


def test_there_are_configs() -> None:
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_bench_config_validates(path: Path) -> None:
    cfg = TandemConfig.from_yaml(path)
    assert cfg.decode.replicas >= 1
