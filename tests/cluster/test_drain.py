"""Draining and stopping: a redeploy lets in-flight streams finish on the replicas it replaces;
Ctrl-C on ``tandem serve`` stops everything within seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ray import serve
from ray.serve._private.build_app import build_app as serve_build_app

from cluster.builder import build_app
from cluster.config import TandemConfig
from runtime.ports import free_port
from tests.cluster.conftest import running_app


def _config(tiny_folder: Path) -> dict[str, Any]:
    return {
        "mode": "colocated",
        "model": {"source": str(tiny_folder), "name": "tiny"},
        "decode": {"num_blocks": 128, "num_threads": 1, "drain_timeout_s": 60},
        "auth": {"required": False},  # on loopback, open: the tests send no key
    }


@pytest.fixture(scope="module")
def app(tiny_folder: Path) -> Iterator[tuple[str, TandemConfig]]:
    cfg = TandemConfig.model_validate(_config(tiny_folder))
    with running_app(cfg) as url:
        yield url, cfg


def test_ingress_drains_as_long_as_the_slowest_pool_behind_it(tiny_folder: Path) -> None:
    # A redeploy replaces the ingress too; with Serve's default 20 s it would cut client streams
    # that the decode replica is still allowed to finish.
    data = {
        "model": {"source": str(tiny_folder)},
        "auth": {"required": False},
        "prefill": {"drain_timeout_s": 90},
        "decode": {"drain_timeout_s": 45},
    }
    built = serve_build_app(build_app(TandemConfig.model_validate(data)), name="tandem")
    timeouts = {d.name: d._deployment_config.graceful_shutdown_timeout_s for d in built.deployments}
    assert timeouts == {"ingress": 90, "prefill": 90, "decode": 45}


def test_rebuilding_an_unchanged_config_gives_the_ingress_the_same_settings(
    tiny_folder: Path,
) -> None:
    # Serve replaces a replica whose init args change; a re-apply of the same config must not.
    cfg = TandemConfig.model_validate(_config(tiny_folder))
    first, second = (
        next(
            d
            for d in serve_build_app(build_app(cfg), name="tandem").deployments
            if d.name == "ingress"
        )
        for _ in range(2)
    )
    settings = first.init_args[0]
    assert settings == second.init_args[0]
    assert settings.created == int((tiny_folder / "config.json").stat().st_mtime)


@pytest.mark.ray
@pytest.mark.slow
def test_redeploy_lets_in_flight_streams_finish(app: tuple[str, TandemConfig]) -> None:
    url, cfg = app
    body = {"model": "tiny", "prompt": [7, 8, 9, 10] * 4, "max_tokens": 1900, "stream": True}
    events: list[dict[str, Any]] = []
    redeployed = threading.Event()

    def redeploy() -> None:  # a new decode version: Serve replaces the replica
        serve.run(build_app(cfg.with_overrides(**{"decode.num_blocks": 160})), name="tandem")
        redeployed.set()

    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line.removeprefix("data: ")))
            if len(events) == 5:
                threading.Thread(target=redeploy, daemon=True).start()
    assert all("error" not in e for e in events), events[-1]
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert redeployed.wait(180), "the redeploy did not finish"
    health = httpx.get(f"{url}/health", timeout=30).json()
    assert health["decode"]["num_blocks"] == 160  # the new replica serves
    assert health["decode"]["free_blocks"] == 160 and health["decode"]["running"] == 0
    r2 = httpx.post(
        f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60
    )
    assert r2.status_code == 200


@pytest.mark.ray
@pytest.mark.slow  # starts its own `tandem serve`
def test_ctrl_c_stops_tandem_serve_within_seconds(tiny_folder: Path, tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(_config(tiny_folder) | {"http": {"port": free_port()}}))
    env = os.environ | {"PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(config)]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 240
        serving = False
        while time.monotonic() < deadline and not serving:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            serving = "tandem is serving" in line
        assert serving, "tandem serve did not come up"
        started_s, t0 = time.monotonic() - t0, time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=max(60.0, started_s))
        took = time.monotonic() - t0
        # within seconds: sooner than it took to come up, on this machine and under its load
        assert rc == 0 and took < started_s, f"exit {rc} after {took:.1f} s ({started_s:.1f} s up)"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
