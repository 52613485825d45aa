"""The `ray up` cluster configs: valid for Ray's own launcher, and big enough for the apps
they are meant to run (pool resources, GPUs, models in every node's cache)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import ray.autoscaler
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.config import PoolConfig, TandemConfig
from tests.deploy.paths import DEPLOY, load_yaml

CLUSTERS = sorted((DEPLOY / "ray-up").glob("*.yaml"))
# Which app configs each cluster is meant to run.
APPS = {
    "aws": ["gpu-disaggregated", "gpu-colocated"],
    "gcp": ["gpu-disaggregated", "gpu-colocated"],
    "local": ["local-colocated", "local-disaggregated"],
}


def _schema() -> dict[str, Any]:
    path = Path(ray.autoscaler.__file__).parent / "ray-schema.json"
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def _apps(cluster: Path) -> list[TandemConfig]:
    return [TandemConfig.from_yaml(DEPLOY / "apps" / f"{a}.yaml") for a in APPS[cluster.stem]]


def test_every_cluster_config_is_covered() -> None:
    assert {p.stem for p in CLUSTERS} == set(APPS)


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_cluster_config_validates_against_ray_schema(path: Path) -> None:
    raw = load_yaml(path)
    jsonschema.validate(raw, _schema())
    # What `ray up` itself does before launching anything: defaults, then the schema again.
    validate_config(prepare_config(raw))


def test_schema_check_catches_a_misspelt_field() -> None:
    raw = load_yaml(DEPLOY / "ray-up" / "aws.yaml")
    bad = copy.deepcopy(raw)
    bad["available_node_types"]["decode_h200"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        jsonschema.validate(bad, _schema())


def _pool_capacity(cluster: dict[str, Any], pool: PoolConfig) -> tuple[int, int]:
    """Units of the pool's resource on the most nodes allowed, and GPUs per unit on them."""
    units, gpus_per_unit = 0, 0
    for node_type in cluster["available_node_types"].values():
        per_node = node_type["resources"].get(pool.resource, 0)
        if per_node:
            units += per_node * node_type.get("max_workers", 0)
            gpus_per_unit = node_type["resources"].get("GPU", 0) // per_node
    return units, gpus_per_unit


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_gpu_pools_fit_the_apps(cloud: str) -> None:
    cluster = load_yaml(DEPLOY / "ray-up" / f"{cloud}.yaml")
    types = cluster["available_node_types"]
    assert "GPU" not in types[cluster["head_node_type"]]["resources"]  # a CPU head
    for cfg in _apps(DEPLOY / "ray-up" / f"{cloud}.yaml"):
        pools = [cfg.decode] + ([cfg.prefill] if cfg.mode == "disaggregated" else [])
        for pool in pools:
            units, gpus_per_unit = _pool_capacity(cluster, pool)
            assert units >= pool.most_replicas() * pool.tp, (cloud, pool.resource)
            assert gpus_per_unit == 1, "one pool unit per GPU: a replica asks for tp of each"
    prefill = [t for t in types.values() if "prefill_pool" in t["resources"]]
    decode = [t for t in types.values() if "decode_pool" in t["resources"]]
    assert len(prefill) == len(decode) == 1
    assert prefill[0]["min_workers"] <= prefill[0]["max_workers"]
    assert decode[0]["min_workers"] <= decode[0]["max_workers"]
    assert sum(t.get("max_workers", 0) for t in types.values()) <= cluster["max_workers"]


def test_local_head_offers_both_pools() -> None:
    cluster = load_yaml(DEPLOY / "ray-up" / "local.yaml")
    start = " ".join(cluster["head_start_ray_commands"])
    m = re.search(r"--resources='([^']+)'", start)
    assert m is not None, "the local head must advertise the pool resources"
    offered = json.loads(m[1])
    for cfg in _apps(DEPLOY / "ray-up" / "local.yaml"):
        for resource, needed in cfg.local_resources().items():
            assert offered.get(resource, 0) >= needed, resource


def _hub_models(cfg: TandemConfig) -> set[str]:
    sources = {cfg.model.source, cfg.draft.source or "embedded"}
    return {s for s in sources if s != "embedded" and not s.startswith(("/", "."))}


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_setup_installs_the_project_and_fetches_the_apps_models(cloud: str) -> None:
    cluster = load_yaml(DEPLOY / "ray-up" / f"{cloud}.yaml")
    commands = cluster["setup_commands"]
    assert any("pip install" in c and "~/tandem" in c for c in commands)
    assert cluster["file_mounts"] == {"~/tandem": "."}
    fetched = {c.split()[2] for c in commands if c.startswith("hf download ")}
    for cfg in _apps(DEPLOY / "ray-up" / f"{cloud}.yaml"):
        assert _hub_models(cfg) <= fetched


def test_aws_gpu_nodes_are_wired_for_efa() -> None:
    """KV crosses the pools over EFA: every interface of each GPU node type in one subnet and
    security group (EFA stays within a subnet), the devices and unlimited memlock handed to the
    container, and libfabric installed in it for NIXL's LIBFABRIC backend."""
    types = load_yaml(DEPLOY / "ray-up" / "aws.yaml")["available_node_types"]
    gpu_types = [t for t in types.values() if t["resources"].get("GPU")]
    assert len(gpu_types) == 2
    for t in gpu_types:
        nics = t["node_config"]["NetworkInterfaces"]
        assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(32))
        kinds = {n["NetworkCardIndex"]: n["InterfaceType"] for n in nics}
        assert kinds.pop(0) == "efa" and set(kinds.values()) == {"efa-only"}
        assert (
            len({n["SubnetId"] for n in nics}) == 1 and len({tuple(n["Groups"]) for n in nics}) == 1
        )
        assert t["node_config"]["Placement"]["GroupName"]
        run = t["docker"]["worker_run_options"]
        assert "--device=/dev/infiniband" in run and "--ulimit memlock=-1:-1" in " ".join(run)
        assert any("install_fabrics.sh --efa" in c for c in t["worker_setup_commands"])
