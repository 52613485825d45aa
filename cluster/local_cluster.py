"""A one-machine Ray cluster whose custom resources simulate the prefill and decode pools."""

from __future__ import annotations

import logging
import os
import threading

import ray
from ray import serve

from cluster.auth import load_keys
from cluster.config import TandemConfig

log = logging.getLogger(__name__)
GRPC_MAX_MESSAGE_ENV = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
LOOPBACK = "127.0.0.1"


def start_ray(
    cfg: TandemConfig,
    address: str | None = None,
    num_cpus: int | None = None,
    dashboard: bool = False,
    metrics_port: int | None = None,
) -> None:
    """Connect to ``address``, or start a local Ray with one custom resource per pool."""
    if address:
        ray.init(address=address)
        return
    # read by Serve's gRPC proxy, a process this Ray starts: its default is 2 GiB
    os.environ[GRPC_MAX_MESSAGE_ENV] = str(cfg.limits.max_body_bytes)
    ray.init(
        num_cpus=num_cpus if num_cpus is not None else os.cpu_count(),
        resources=cfg.local_resources(),
        include_dashboard=dashboard,
        dashboard_host=LOOPBACK,  # its Jobs API runs arbitrary code
        log_to_driver=True,
        _metrics_export_port=metrics_port,
    )


def start_serve(cfg: TandemConfig) -> None:
    """Serve's proxies: HTTP on ``http.host:http.port``, and gRPC on ``grpc.port`` unless off."""
    http = cfg.http_options()
    grpc = cfg.grpc_options()
    if grpc is not None and not load_keys(cfg.auth).enabled:
        log.warning(
            "the gRPC API listens on every interface at port %d with no API keys "
            "(grpc.enabled: false turns it off)",
            cfg.grpc.port,
        )
    serve.start(http_options=http, grpc_options=grpc)


def shutdown(grace_s: float = 5.0) -> None:
    """Stop Serve, giving in-flight requests at most ``grace_s`` (not each pool's whole
    ``drain_timeout_s``: this is an operator's Ctrl-C), then Ray regardless."""
    done = threading.Event()

    def _serve_down() -> None:
        try:
            serve.shutdown()
        except Exception as e:  # Ray may already be going away
            log.warning("serve.shutdown: %s", e)
        finally:
            done.set()

    threading.Thread(target=_serve_down, name="serve-shutdown", daemon=True).start()
    if not done.wait(grace_s):
        log.warning("Serve did not stop within %.0f s; stopping Ray anyway", grace_s)
    ray.shutdown()
