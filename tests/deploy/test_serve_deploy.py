"""The committed local Serve config, deployed the way operators deploy it (`serve deploy` to the
dashboard of a running Ray cluster whose node offers the pool resources, with the API keys in
the nodes' environment: the config is closed by default), answers over HTTP and gRPC."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import ray
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ray import serve
from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

from cluster.config import TandemConfig
from cluster.proto import tandem_pb2 as pb
from cluster.proto import tandem_pb2_grpc
from models.embedded import EMBEDDED_NAME
from runtime.ports import free_port
from tests.deploy.paths import DEPLOY, load_yaml
from tests.helpers import wait_until

pytestmark = pytest.mark.ray

SERVE_FILE = DEPLOY / "serve" / "local-colocated.yaml"
KEY = "sk-tandem-serve-deploy-key-01"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass(frozen=True)
class Deployed:
    api: str  # the OpenAI API
    dashboard: str  # Ray's dashboard, where `serve deploy` sent the config
    grpc: str  # the gRPC API's address


def _healthy(base: str) -> dict[str, Any]:
    r = httpx.get(f"{base}/health", headers=AUTH, timeout=5)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.fixture(scope="module")
def deployed(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    """A local Ray offering the config's pool resources, with the Serve file deployed."""
    doc = load_yaml(SERVE_FILE)
    cfg = TandemConfig.from_yaml(DEPLOY / "apps" / SERVE_FILE.name)  # for the pool resources
    port, dashboard, grpc_port = free_port(), free_port(), free_port()
    doc["http_options"]["port"] = port  # the only changes: ports free on this machine
    doc["grpc_options"]["port"] = grpc_port
    path = tmp_path_factory.mktemp("serve") / SERVE_FILE.name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    # as the ray-up files do: the keys in the environment Ray starts with (every node's)
    saved = os.environ.get("TANDEM_API_KEYS")
    os.environ["TANDEM_API_KEYS"] = KEY
    ray.init(
        num_cpus=2,
        resources=cfg.local_resources(),
        include_dashboard=True,
        dashboard_port=dashboard,
    )
    try:
        serve_cli = Path(sys.executable).parent / "serve"
        address = f"http://127.0.0.1:{dashboard}"
        subprocess.run([serve_cli, "deploy", str(path), "-a", address], check=True, timeout=120)
        base = f"http://127.0.0.1:{port}"
        health = wait_until(
            lambda: _healthy(base), 300, "the app healthy", ignoring=(httpx.HTTPError,)
        )
        assert health["mode"] == "colocated"
        yield Deployed(base, address, f"127.0.0.1:{grpc_port}")
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            del os.environ["TANDEM_API_KEYS"]
        else:
            os.environ["TANDEM_API_KEYS"] = saved


def test_deployed_serve_config_answers_a_chat_request(deployed: Deployed) -> None:
    r = httpx.post(
        f"{deployed.api}/v1/chat/completions",
        json={
            "model": EMBEDDED_NAME,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        },
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"].strip()
    assert body["usage"]["completion_tokens"] >= 1
    # The config's draft is the shipped head (`source: embedded`), found where Serve builds the
    # app, not relative to the directory `serve deploy` ran in: it drafted.
    assert body["usage"]["speculative"]["draft_tokens"] > 0


def test_deployed_serve_config_serves_grpc(deployed: Deployed) -> None:
    """The rendered grpc_options register tandem.v1 and the health service where Serve runs."""
    with grpc.insecure_channel(deployed.grpc) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=60)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = pb.GenerateRequest(
            model=EMBEDDED_NAME,
            text="The capital of France is",
            # ignore_eos: the default temperature samples, and a sampled end of text may come
            # before the fourth token
            sampling=pb.SamplingOptions(max_tokens=4, ignore_eos=True),
        )
        stub = tandem_pb2_grpc.TandemStub(ch)
        (reply,) = list(
            stub.Generate(request, metadata=(("authorization", AUTH["Authorization"]),), timeout=60)
        )
        assert reply.usage.completion_tokens == 4 and reply.text


def test_serve_runs_the_deployments_the_config_sizes(deployed: Deployed) -> None:
    rendered = {d["name"]: d for d in load_yaml(SERVE_FILE)["applications"][0]["deployments"]}
    # What `serve status` reads: the deployments as Serve runs them, over the dashboard's API.
    app = ServeSubmissionClient(deployed.dashboard).get_serve_details()["applications"]["tandem"]
    assert app["status"] == "RUNNING"
    assert set(app["deployments"]) == {"ingress", *rendered}
    decode = app["deployments"]["decode"]
    scaling = decode["deployment_config"]["autoscaling_config"]
    for key, value in rendered["decode"]["autoscaling_config"].items():
        assert scaling[key] == value, key
    assert [r["state"] for r in decode["replicas"]] == ["RUNNING"]  # min_replicas, no load
