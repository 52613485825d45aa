"""A bounded soak of hostile traffic (bad inputs, abandoned streams, cancellations) on the
disaggregated path: afterwards every KV block on both pools is free and no lease is held, and
no request got a 5xx."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.chaos import mixed_traffic
from cluster.config import TandemConfig
from tests.cluster.conftest import running_app
from tests.helpers import wait_until

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def app(tiny_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "draft": {"kind": "ngram"},
            "prefill": {"num_blocks": 128, "num_threads": 1, "lease_seconds": 5},
            "decode": {"num_blocks": 192, "num_threads": 1},
            "limits": {"max_body_bytes": 65536},
        }
    )
    with running_app(cfg) as url:
        yield url


def _pools(url: str) -> dict[str, Any]:
    h: dict[str, Any] = httpx.get(f"{url}/health", timeout=30).json()
    return {
        "decode_free": h["decode"]["free_blocks"],
        "decode_running": h["decode"]["running"] + h["decode"]["waiting"] + h["decode"]["pulling"],
        "prefill_free": h["prefill"]["free_blocks"],
        "leases": h["prefill"]["active_leases"],
    }


@pytest.mark.slow  # 20 s of traffic
def test_hostile_mix_leaks_no_blocks(app: str) -> None:
    before = _pools(app)
    assert before == {"decode_free": 192, "decode_running": 0, "prefill_free": 128, "leases": 0}
    outcomes = asyncio.run(mixed_traffic(app, seconds=20, concurrency=4, model="tiny", seed=3))
    kinds = {k.split(":")[0] for k in outcomes}
    assert {"stream", "abandon", "cancel", "bad_json", "too_long"} <= kinds, outcomes
    assert not [k for k in outcomes if k.split(":")[1].startswith("5")], outcomes
    assert outcomes.get("bad_json:400", 0) + outcomes.get("bad_field:400", 0) > 0
    assert outcomes.get("abandon:abandoned", 0) > 0 and outcomes.get("stream:ok", 0) > 0

    def restored() -> bool:
        after = _pools(app)
        assert after == before, (after, outcomes)
        return True

    # abandoned handoffs' leases expire after 5 s
    wait_until(restored, 30, "every block and lease back", interval_s=1)
