"""The KubeRay manifests: valid against the ray.io/v1 CRDs, one worker group per pool with its
resources and GPUs, a serveConfigV2 that is the rendered Serve config of its app, and closed by
default: keys from a Secret in every pod, no root, a NetworkPolicy fencing all but the API."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from cluster.config import TandemConfig
from tests.deploy import crds
from tests.deploy.paths import DEPLOY, load_yaml

# every KubeRay manifest here (the NetworkPolicy is plain Kubernetes); kustomization.yaml makes
# the folder a kustomize base
POLICY = DEPLOY / "kuberay" / "networkpolicy.yaml"
MANIFESTS = sorted(
    p
    for p in (DEPLOY / "kuberay").glob("*.yaml")
    if p.name not in ("kustomization.yaml", POLICY.name)
)
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture(scope="module")
def schemas() -> dict[tuple[str, str], crds.Schema]:
    return crds.load_schemas()


def _service() -> dict[str, Any]:
    doc: dict[str, Any] = load_yaml(DEPLOY / "kuberay" / "rayservice.yaml")
    return doc


def _app_config(service: dict[str, Any]) -> TandemConfig:
    """The app config the service's serveConfigV2 is rendered from (it names it)."""
    text = (DEPLOY / "kuberay" / "rayservice.yaml").read_text()
    m = re.search(r"# tandem-render: serveConfigV2 from (\S+)", text)
    assert m is not None
    cfg = TandemConfig.from_yaml(DEPLOY / m[1])
    block = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    assert block["args"]["config"]["model"] == cfg.model.model_dump(mode="json", exclude_unset=True)
    return cfg


def _pool_resources(group: dict[str, Any]) -> dict[str, float]:
    """rayStartParams.resources as Ray reads it: JSON, possibly wrapped in quotes."""
    raw = group["rayStartParams"]["resources"].strip()
    parsed: dict[str, float] = json.loads(json.loads(raw) if raw.startswith('"') else raw)
    return parsed


def test_both_kinds_are_shipped() -> None:
    kinds = {load_yaml(p)["kind"] for p in MANIFESTS}
    assert kinds == {"RayService", "RayCluster"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_its_crd(
    path: Path, schemas: dict[tuple[str, str], crds.Schema]
) -> None:
    manifest = load_yaml(path)
    crds.validate(manifest, schemas)
    assert DNS_1123.match(manifest["metadata"]["name"])


@pytest.mark.parametrize(
    ("where", "value", "needle"),
    [
        (("workerGroupSpecs", 0, "maxReplica"), 2, "'maxReplica' was unexpected"),
        (("workerGroupSpecs", 0, "rayStartParams", "num-gpus"), 8, "8 is not of type 'string'"),
        (("workerGroupSpecs", 0, "minReplicas"), "one", "'one' is not of type 'integer'"),
        (
            ("headGroupSpec", "template", "spec", "containers", 0, "imagePullPolicy"),
            None,
            "None is not of type",
        ),
    ],
)
def test_crd_check_catches_mistakes(
    where: tuple[Any, ...], value: Any, needle: str, schemas: dict[tuple[str, str], crds.Schema]
) -> None:
    bad = copy.deepcopy(_service())
    node = bad["spec"]["rayClusterConfig"]
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    with pytest.raises(jsonschema.ValidationError, match=re.escape(needle)):
        crds.validate(bad, schemas)


def test_crd_location_can_be_overridden(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    raycluster_crds = [p for p in crds.crd_paths() if "kind: RayCluster\n" in p.read_text()]
    assert raycluster_crds, "the configured CRDs include RayCluster"
    monkeypatch.setenv(crds.ENV, str(raycluster_crds[0]))
    assert {kind for _, kind in crds.load_schemas()} == {"RayCluster"}
    monkeypatch.setenv(crds.ENV, str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=crds.ENV):
        crds.load_schemas()


def test_serve_config_v2_is_the_rendered_serve_config() -> None:
    block = yaml.safe_load(_service()["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(block)
    assert block == load_yaml(DEPLOY / "serve" / "gpu-disaggregated.yaml")


def test_one_worker_group_per_pool_with_its_resource_and_gpus() -> None:
    service = _service()
    cfg = _app_config(service)
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for name, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        group = groups[name]
        units = _pool_resources(group)
        assert set(units) == {pool.resource}
        (container,) = group["template"]["spec"]["containers"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert container["resources"]["requests"]["nvidia.com/gpu"] == str(gpus)
        assert units[pool.resource] == gpus  # one pool unit per GPU
        assert group["maxReplicas"] * gpus >= pool.most_replicas() * pool.tp
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        spec = group["template"]["spec"]
        assert spec["nodeSelector"] and any(
            t["key"] == "nvidia.com/gpu" for t in spec["tolerations"]
        )
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in head["containers"][0]["resources"]["limits"]


def test_raycluster_is_the_rayservice_cluster() -> None:
    cluster = load_yaml(DEPLOY / "kuberay" / "raycluster.yaml")
    assert cluster["spec"] == _service()["spec"]["rayClusterConfig"]


def test_image_bakes_in_the_apps_models() -> None:
    cfg = _app_config(_service())
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    fetched = set(re.findall(r"hf download (\S+)", dockerfile))
    assert {cfg.model.source, cfg.draft.source} <= fetched
    images = {
        c["image"]
        for g in [
            _service()["spec"]["rayClusterConfig"]["headGroupSpec"],
            *_service()["spec"]["rayClusterConfig"]["workerGroupSpecs"],
        ]
        for c in g["template"]["spec"]["containers"]
    }
    assert len(images) == 1  # one image: the Dockerfile's


def test_the_image_and_make_install_pin_the_same_cuda_torch() -> None:
    """The GPU torch is the one the device checks ran on, in both places that install one."""
    script = (DEPLOY.parent / "tools" / "install_torch.sh").read_text()
    version = re.search(r'^GPU_TORCH="([\d.]+)"$', script, re.M)
    index = re.search(r'^GPU_INDEX="(\S+)"$', script, re.M)
    assert version and index
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert f'"torch=={version.group(1)}"' in dockerfile
    assert f"--index-url {index.group(1)}" in dockerfile
    assert re.search(r"pip install[^\n]*\btorch\b(?!==)", dockerfile) is None  # never unpinned


def test_the_kustomize_base_lists_only_manifests_of_its_own_folder() -> None:
    """kustomize refuses a resource outside the kustomization's folder; the base must list
    files that are here, and the RayService (not the hand-run RayCluster beside it)."""
    base = load_yaml(DEPLOY / "kuberay" / "kustomization.yaml")
    assert base["kind"] == "Kustomization"
    names = [m.name for m in (*MANIFESTS, POLICY)]
    assert base["resources"] == ["rayservice.yaml", POLICY.name]
    assert set(base["resources"]) <= set(names)


def _pod_templates(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    spec = manifest["spec"].get("rayClusterConfig", manifest["spec"])
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def test_the_pod_monitor_scrapes_every_pod_and_the_dashboard_is_provisioned() -> None:
    """deploy/kuberay/monitoring/ (its own kustomization): the PodMonitor's selector matches
    every pod template of both manifests, whose containers all expose the port it scrapes;
    the Grafana dashboard ConfigMap is made from a JSON file of that folder and carries the
    label Grafana's sidecar provisions from."""
    folder = DEPLOY / "kuberay" / "monitoring"
    kust = load_yaml(folder / "kustomization.yaml")
    assert kust["kind"] == "Kustomization"
    assert all((folder / r).is_file() for r in kust["resources"])
    monitor = load_yaml(folder / "podmonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    want = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for path in MANIFESTS:
        for template in _pod_templates(load_yaml(path)):
            labels = template["metadata"]["labels"]
            assert want.items() <= labels.items(), (path.name, labels)
            for c in template["spec"]["containers"]:
                assert ports <= {p.get("name") for p in c.get("ports", [])}, (path.name, c["name"])
    (dashboard,) = kust["configMapGenerator"]
    assert dashboard["options"]["labels"]["grafana_dashboard"] == "1"
    for file in dashboard["files"]:
        doc = json.loads((folder / file).read_text())
        assert doc["uid"] and any(p.get("targets") for p in doc["panels"])


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_pod_takes_its_keys_from_the_secret_and_runs_unprivileged(path: Path) -> None:
    """The app may be built on any node (KubeRay runs the build task wherever), so every
    container gets the keys; none runs as root or may escalate, each drops every capability
    (the workers add back only IPC_LOCK, which UCX needs to register KV memory)."""
    for template in _pod_templates(load_yaml(path)):
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["seccompProfile"]["type"] == "RuntimeDefault"
        for c in template["spec"]["containers"]:
            env = {e["name"]: e for e in c["env"]}
            ref = env["TANDEM_API_KEYS"]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": "tandem-api-keys", "key": "keys"}
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
    cfg = _app_config(_service())
    assert cfg.auth.required and cfg.auth.api_keys_env == "TANDEM_API_KEYS"


def test_the_network_policy_opens_only_the_api_to_everyone() -> None:
    policy = load_yaml(POLICY)
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    labels = policy["spec"]["podSelector"]["matchLabels"]
    for path in MANIFESTS:  # it selects every pod of both manifests
        for template in _pod_templates(load_yaml(path)):
            assert labels.items() <= template["metadata"]["labels"].items()
    open_ports: set[int] = set()
    for rule in policy["spec"]["ingress"]:
        if "from" not in rule:  # from anywhere: only these ports
            open_ports |= {p["port"] for p in rule["ports"]}
        else:
            assert all(peer for peer in rule["from"])  # no empty peer (that would be anyone)
    assert open_ports == {8000, 9000}
    dashboard = int(
        _service()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][
            0
        ]["ports"][1]["containerPort"]
    )
    assert dashboard == 8265 and dashboard not in open_ports
