"""A local tandem app for a benchmark run: Ray with the config's pools, Serve's proxies on the
config's ports (gRPC as configured), the app deployed; torn down (Serve, then Ray) when the
run ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import ray
from ray import serve

from cluster.builder import build_app
from cluster.config import TandemConfig
from cluster.local_cluster import start_ray


@contextlib.contextmanager
def local_app(cfg: TandemConfig, num_cpus: int) -> Iterator[str]:
    """Serve ``cfg`` on this machine; yields the OpenAI base URL (``http://127.0.0.1:PORT/v1``).
    Open (no API key needed) unless the config names a keys file: it binds loopback only."""
    if cfg.auth.api_keys_file is None:
        cfg = cfg.with_overrides(**{"auth.required": False})
    start_ray(cfg, num_cpus=num_cpus)
    try:
        serve.start(
            http_options=cfg.http_options() | {"host": "127.0.0.1"},
            grpc_options=cfg.grpc_options(),
        )
        serve.run(build_app(cfg), name="tandem", route_prefix="/")
        yield f"http://127.0.0.1:{cfg.http.port}/v1"
    finally:
        serve.shutdown()
        ray.shutdown()
