"""The goodput autoscaling policy live: decode replicas report their capacity within the SLO
to Ray Serve's controller, which imports ``cluster.capacity_policy`` and scales the pool on it.

The SLO is set below one step of the tiny model, so every replica predicts a capacity of zero
streams: the SLO is out of reach, and a replica counts what one stream alone gets as its
capacity in tokens per second. Four greedy streams deliver more than that, so the pool scales
out, where Serve's request-count rule with the same traffic (four streams, a target of eight
per replica) would keep one replica. The replica it
adds starts mid-traffic and seeds its acceptance calibration from the first one's
(``serving.shared_priors``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ray import serve
from ray.serve._private.common import ReplicaState

from cluster.config import TandemConfig
from serving.autoscaling_metrics import CAPACITY, CAPACITY_TOK_S, GOODPUT_TOK_S, STREAMS
from tests.cluster.conftest import running_app
from tests.helpers import wait_until

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def app(tiny_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "draft": {"kind": "ngram", "num_speculative_tokens": 3},
            "ingress": {"replicas": 1},
            "decode": {
                "num_blocks": 256,
                "num_threads": 1,
                "routing_tpot_slo_s": 1e-5,
                "autoscaling": {
                    "policy": "goodput",
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 8,
                    "upscale_delay_s": 0,
                    "look_back_period_s": 11,
                },
            },
        }
    )
    with running_app(cfg) as url:
        yield url


def _decode_replicas() -> int:
    status = serve.status().applications["tandem"].deployments["decode"]
    return int(status.replica_states.get(ReplicaState.RUNNING, 0))


@pytest.mark.timeout(240)
def test_replicas_report_capacity_and_the_pool_scales_on_it(app: str) -> None:
    assert _decode_replicas() == 1
    stop = threading.Event()
    answered: list[int] = []

    def load() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                r = client.post(
                    f"{app}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": [5, 6, 7, 8],
                        "max_tokens": 200,
                        "temperature": 0,  # greedy: the tiny model loops, n-gram lookup drafts
                    },
                )
                answered.append(r.status_code)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        decode = serve.get_deployment_handle("decode", app_name="tandem")

        def reporting() -> dict[str, float]:
            report: dict[str, float] = decode.record_autoscaling_stats.remote().result(timeout_s=30)
            assert report.get(STREAMS) and report[GOODPUT_TOK_S], report
            return report

        report = wait_until(reporting, 60, "decode reporting streams and goodput", interval_s=0.2)
        # what Serve's controller receives: streams in flight, a capacity, delivered goodput
        assert report[STREAMS] >= 1 and report[CAPACITY] == 0.0 and report[GOODPUT_TOK_S] > 0
        assert report[CAPACITY_TOK_S] > 0  # one stream's goodput
        wait_until(lambda: _decode_replicas() >= 2, 120, "a second decode replica", interval_s=1)
        assert _decode_replicas() == 2
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert answered and set(answered) == {200}
    pool = httpx.get(f"{app}/health", timeout=30).json()["pools"]["decode"]["replicas"]
    seeded = sorted(r["seeded_tokens"] for r in pool.values())
    assert len(seeded) == 2 and seeded[0] == 0.0 and seeded[1] > 0  # the first had no siblings
