"""``bench.hostile``'s battery over real HTTP and gRPC (a disaggregated app of a tiny random
model, with a key): every case a 4xx naming its field or limit, or a correct 200; never a 5xx or
a hang. Afterwards every KV block, lease and admission slot is back and greedy output is what it
was before. Also: with keys set, every route but /health needs one, and this loopback server's
Ray listens on loopback only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from bench.hostile import battery
from cluster.config import TandemConfig
from cluster.proto import tandem_pb2 as pb
from cluster.proto import tandem_pb2_grpc
from tests.cluster.conftest import running_app_ports

pytestmark = pytest.mark.ray

KEY = "sk-tandem-hostile-test-key-01"
HEADERS = {"Authorization": f"Bearer {KEY}"}
BLOCKS = 128
BODY_LIMIT = 65536
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def app(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    keys = tmp_path_factory.mktemp("hostile_auth") / "keys"
    keys.write_text(KEY + "\n")
    cfg = TandemConfig.model_validate(
        {
            "mode": "disaggregated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "draft": {"kind": "ngram"},
            # leases outlive the test: only releases and reads may bring them back
            "prefill": {"num_blocks": BLOCKS, "num_threads": 1, "lease_seconds": 300},
            "decode": {"num_blocks": BLOCKS, "num_threads": 1},
            "ingress": {"replicas": 1},
            "auth": {"api_keys_file": str(keys), "api_keys_env": "TANDEM_TEST_NO_SUCH_VAR"},
            "limits": {
                "max_model_len": 1024,
                "max_body_bytes": BODY_LIMIT,
                "body_timeout_s": BODY_TIMEOUT_S,
                "max_stop_sequences": 4,
            },
        }
    )
    with running_app_ports(cfg) as ports:
        yield ports


@pytest.mark.timeout(600)
def test_hostile_inputs_get_4xx_and_leave_nothing_behind(app: tuple[str, int]) -> None:
    base, grpc_port = app
    report = battery(base, grpc_port, KEY, BODY_LIMIT, BODY_TIMEOUT_S)
    assert not report["failed"], [o for o in report["outcomes"] if not o["ok"]]
    assert report["server_errors"] == report["no_answer"] == 0
    assert report["cases"] >= 30
    assert report["settled_ok"], str(report["settled"])  # every block, lease and slot back
    assert report["greedy_unchanged"]


def test_with_keys_every_route_but_health_needs_one(app: tuple[str, int]) -> None:
    base, grpc_port = app
    for method, path in (
        ("GET", "/v1/models"),
        ("GET", "/v1/models/tiny"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/no/such/route"),
    ):
        r = httpx.request(method, f"{base}{path}", json={}, timeout=30)
        assert r.status_code == 401, (path, r.status_code)
    anonymous = httpx.get(f"{base}/health", timeout=30)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    keyed = httpx.get(f"{base}/health", headers=HEADERS, timeout=30).json()
    assert keyed["decode"]["num_blocks"] == BLOCKS  # the whole body, with a key
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = tandem_pb2_grpc.TandemStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ListModels(pb.ListModelsRequest(), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        req = pb.GenerateRequest(model="tiny", token_ids=pb.TokenIds(ids=[5, 6]))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_dashboard_and_the_http_api_listen_on_loopback_only(app: tuple[str, int]) -> None:
    """The dashboard (its Jobs API runs arbitrary code) and this server's HTTP API bind
    loopback. Ray 2.60's own gRPC servers (GCS, raylet, workers) bind every interface and have
    no option not to: on a shared network, a firewall is what keeps them in."""
    import os

    import psutil

    base, _ = app
    http_port = int(base.rsplit(":", 1)[1])
    ours = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    listening = [
        c.laddr
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    ]
    api = {a.ip for a in listening if a.port == http_port}
    assert api and all(h.startswith("127.") for h in api), api
    dashboard = {a.ip for a in listening if a.port == 8265}  # where started (`tandem serve`)
    assert all(h.startswith("127.") for h in dashboard), dashboard
