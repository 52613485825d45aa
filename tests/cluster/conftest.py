from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import ray
from ray import serve

from cluster.builder import build_app
from cluster.config import TandemConfig
from cluster.local_cluster import start_ray
from tests.helpers import free_port


@contextmanager
def running_app(cfg: TandemConfig) -> Iterator[str]:
    """A real local Ray cluster with both pools, the app deployed, HTTP on a free port."""
    cfg = cfg.with_overrides(**{"http.port": free_port()})
    start_ray(cfg, num_cpus=2)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": cfg.http.port})
        serve.run(build_app(cfg), name="tandem", route_prefix="/")
        base = f"http://127.0.0.1:{cfg.http.port}"
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()
