"""The fabric overlays of the KubeRay manifests (deploy/kuberay-fabrics/): each is a kustomize
overlay of deploy/kuberay whose JSON patches, applied to the RayService, still validate against
the ray.io/v1 CRDs and give both pools' pods what their fabric needs: the devices (EFA or RDMA)
in requests and limits alike, IPC_LOCK to register KV memory, hugepages for EFA, the networks."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import pytest
import yaml

from tests.deploy import crds
from tests.deploy.paths import DEPLOY, load_yaml

FABRICS = DEPLOY / "kuberay-fabrics"
OVERLAYS = sorted(p.parent for p in FABRICS.glob("*/kustomization.yaml"))
# what each overlay's pods must request, per container, in requests and limits
DEVICES = {
    "efa": {"vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "5120Mi"},
    "ib": {"rdma/rdma_shared_device_a": "1"},
    "gke-a3-ultra": {},
}


def _patched(overlay: Path) -> dict[str, Any]:
    kustomization = load_yaml(overlay / "kustomization.yaml")
    assert kustomization["resources"] == ["../../kuberay"]
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"kind": "RayService", "name": "tandem"}
    service = load_yaml(DEPLOY / "kuberay" / "rayservice.yaml")
    ops = yaml.safe_load(patch["patch"])
    out: dict[str, Any] = jsonpatch.apply_patch(service, ops)
    return out


def _groups(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def test_every_fabric_has_an_overlay() -> None:
    assert {p.name for p in OVERLAYS} == set(DEVICES)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_overlay_validates_and_wires_its_fabric(overlay: Path) -> None:
    service = _patched(overlay)
    crds.validate(service, crds.load_schemas())
    for name, group in _groups(service).items():
        spec = group["template"]["spec"]
        (container,) = spec["containers"]
        resources = container["resources"]
        for key, value in DEVICES[overlay.name].items():
            assert resources["requests"].get(key) == value == resources["limits"].get(key), name
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"], name
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        if overlay.name == "efa":
            assert mounts["hugepages"] == "/dev/hugepages", name
            assert volumes["hugepages"]["emptyDir"]["medium"] == "HugePages-2Mi"
            assert spec["nodeSelector"]["node.kubernetes.io/instance-type"].startswith("p5")
        annotations = group["template"]["metadata"].get("annotations", {})
        if overlay.name == "ib":
            assert annotations["k8s.v1.cni.cncf.io/networks"] == "tandem-rdma"
        if overlay.name == "gke-a3-ultra":
            nets = [n["network"] for n in json.loads(annotations["networking.gke.io/interfaces"])]
            assert [n for n in nets if n.startswith("rdma-")] == [f"rdma-{i}" for i in range(8)]
            assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}


def test_overlays_refuse_a_reordered_base() -> None:
    """The patches address the pools by position, and test each position's name first."""
    service = load_yaml(DEPLOY / "kuberay" / "rayservice.yaml")
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    groups.reverse()
    ops = yaml.safe_load(load_yaml(FABRICS / "efa" / "kustomization.yaml")["patches"][0]["patch"])
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(copy.deepcopy(service), ops)


def test_image_carries_the_fabrics_userspace() -> None:
    dockerfile = (DEPLOY / "docker" / "Dockerfile").read_text()
    assert "tools/install_fabrics.sh" in dockerfile and "echo --efa" in dockerfile
    script = (DEPLOY.parent / "tools" / "install_fabrics.sh").read_text()
    assert "ibverbs-providers" in script and "efa_installer.sh" in script
