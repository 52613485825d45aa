"""A one-machine Ray cluster whose custom resources simulate the prefill and decode pools."""

from __future__ import annotations

import logging
import os

import ray
from ray import serve

from cluster.config import TandemConfig

log = logging.getLogger(__name__)


def start_ray(cfg: TandemConfig, address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to ``address``, or start a local Ray with one custom resource per pool."""
    if address:
        ray.init(address=address)
        return
    ray.init(
        num_cpus=num_cpus if num_cpus is not None else os.cpu_count(),
        resources=cfg.local_resources(),
        include_dashboard=False,
        log_to_driver=True,
    )


def start_serve(cfg: TandemConfig) -> None:
    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})


def shutdown() -> None:
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
