"""The Ray Serve config (``serve run`` / ``serve deploy`` / KubeRay) of an app, from a
``TandemConfig`` alone. Sizing goes to the ``deployments`` entries, not to ``args`` (hashed into
the code version), so resizing a pool restarts no replica."""

from __future__ import annotations

from typing import Any

import yaml

from cluster.config import PoolConfig, TandemConfig

APP_NAME = "tandem"
IMPORT_PATH = "cluster.builder:app_builder"
SIZING = {"replicas", "autoscaling", "max_ongoing_requests"}


def _pools(cfg: TandemConfig) -> list[tuple[str, PoolConfig]]:
    """The pool-pinned deployments, under the names the app builder gives them."""
    pools: list[tuple[str, PoolConfig]] = [("decode", cfg.decode)]
    if cfg.mode == "disaggregated":
        pools.insert(0, ("prefill", cfg.prefill))
    return pools


def deployment_overrides(cfg: TandemConfig) -> list[dict[str, Any]]:
    """Each pool's and the ingress's sizing and admission bound."""
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
    """``args.config``: the fields its YAML set, less the pools' and the ingress's sizing."""
    sized = dict.fromkeys([n for n, _ in _pools(cfg)] + ["ingress"], SIZING)
    data: dict[str, Any] = cfg.model_dump(mode="json", exclude_unset=True, exclude=sized)
    return data


def serve_config(cfg: TandemConfig) -> dict[str, Any]:
    """The ``ServeDeploySchema`` document (plain data) that deploys ``cfg`` as one application."""
    doc: dict[str, Any] = {
        "proxy_location": "EveryNode",
        "http_options": cfg.http_options(),
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
    text: str = yaml.safe_dump(serve_config(cfg), sort_keys=False, default_flow_style=False)
    return text
