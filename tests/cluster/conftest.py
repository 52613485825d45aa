from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import ray
from ray import serve

from cluster.builder import build_app
from cluster.config import TandemConfig
from cluster.local_cluster import start_ray
from runtime.ports import free_port


@contextmanager
def running_app(cfg: TandemConfig) -> Iterator[str]:
    """A real local Ray cluster with both pools, the app deployed, HTTP on a free port."""
    with running_app_ports(cfg) as (base, _):
        yield base


@contextmanager
def running_app_ports(cfg: TandemConfig) -> Iterator[tuple[str, int]]:
    """``running_app``, also giving the gRPC port (free ports for both; gRPC as configured)."""
    overrides: dict[str, object] = {"http.port": free_port(), "grpc.port": free_port()}
    if cfg.auth.api_keys_file is None:  # a test's app on loopback, open unless it sets keys
        overrides["auth.required"] = False
    if "path_check" not in cfg.kv.model_fields_set:  # a process per replica: where asked only
        overrides["kv.path_check"] = False
    cfg = cfg.with_overrides(**overrides)
    start_ray(cfg, num_cpus=2)
    try:
        serve.start(
            http_options=cfg.http_options() | {"host": "127.0.0.1"},
            grpc_options=cfg.grpc_options(),
        )
        serve.run(build_app(cfg), name="tandem", route_prefix="/")
        base = f"http://127.0.0.1:{cfg.http.port}"
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        yield base, cfg.grpc.port
    finally:
        serve.shutdown()
        ray.shutdown()
