"""The Ray Serve config (``serve run`` / ``serve deploy`` / KubeRay ``serveConfigV2``) of an app.

One source of truth: the document is computed from a ``TandemConfig`` and nothing else.

- ``args.config`` embeds the config itself: the fields its YAML set (the installed tandem
  supplies the defaults), *except* each pool's and the ingress's sizing;
- that sizing (``replicas`` or ``autoscaling``, and ``max_ongoing_requests``) goes to the
  application's ``deployments`` entries instead, as the app builder would apply it
  (``PoolConfig.scaling_options``, ``TandemConfig.ingress_scaling``). Serve hashes ``args``
  into the application's code version, so this split lets a change of bounds or targets
  resize the pools in place, without restarting a replica (and reloading its model).

``cluster/render_files.py`` decides which files under ``deploy/`` are rendered.
"""

from __future__ import annotations

from typing import Any

import yaml

from cluster.config import PoolConfig, TandemConfig

APP_NAME = "tandem"
IMPORT_PATH = "cluster.builder:app_builder"
# Pool and ingress fields Serve applies from the `deployments` entries rather than from `args`.
SIZING = {"replicas", "autoscaling", "max_ongoing_requests"}


def _pools(cfg: TandemConfig) -> list[tuple[str, PoolConfig]]:
    """The pool-pinned deployments, under the names the app builder gives them."""
    pools: list[tuple[str, PoolConfig]] = [("decode", cfg.decode)]
    if cfg.mode == "disaggregated":
        pools.insert(0, ("prefill", cfg.prefill))
    return pools


def deployment_overrides(cfg: TandemConfig) -> list[dict[str, Any]]:
    """Per-deployment Serve options: replica count or autoscaling, and the admission bound,
    of each pool and of the ingress."""
    pools = [
        {
            "name": name,
            **pool.scaling_options(),
            "max_ongoing_requests": pool.max_ongoing_requests,
        }
        for name, pool in _pools(cfg)
    ]
    ingress = {
        "name": "ingress",
        **cfg.ingress_scaling(),
        "max_ongoing_requests": cfg.ingress.max_ongoing_requests,
    }
    return [*pools, ingress]


def embedded_config(cfg: TandemConfig) -> dict[str, Any]:
    """The app config as ``args.config`` holds it: as set in its YAML, less the pools' and the
    ingress's sizing."""
    sized = dict.fromkeys([n for n, _ in _pools(cfg)] + ["ingress"], SIZING)
    data: dict[str, Any] = cfg.model_dump(mode="json", exclude_unset=True, exclude=sized)
    return data


def serve_config(cfg: TandemConfig) -> dict[str, Any]:
    """The ``ServeDeploySchema`` document (plain data) that deploys ``cfg`` as one application."""
    doc: dict[str, Any] = {
        "proxy_location": "EveryNode",
        "http_options": {"host": cfg.http.host, "port": cfg.http.port},
    }
    grpc = cfg.grpc_options()
    if grpc is not None:
        doc["grpc_options"] = grpc
    return doc | {
        "applications": [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": IMPORT_PATH,
                "args": {"config": embedded_config(cfg)},
                "deployments": deployment_overrides(cfg),
            }
        ],
    }


def serve_config_yaml(cfg: TandemConfig) -> str:
    """``serve_config`` as YAML, keys in a reading order."""
    text: str = yaml.safe_dump(serve_config(cfg), sort_keys=False, default_flow_style=False)
    return text
