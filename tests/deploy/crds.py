"""Validating manifests against the OpenAPI v3 schemas of CustomResourceDefinitions.

The KubeRay CRDs are read where the workplace provides them (``../shared/schemas/kuberay``
beside the repository), or from ``$TANDEM_KUBERAY_CRDS``: CRD files or folders of them,
separated by ``os.pathsep``, for users who check against the CRDs their cluster runs. They are
never copied into the repository.

A CRD's structural schema is turned into JSON Schema the way the API server reads it with
strict field validation (kubectl's default): an object that lists its properties accepts no
others, ``nullable`` admits null, ``x-kubernetes-int-or-string`` admits either. CEL rules
(``x-kubernetes-validations``) are not evaluated; KubeRay's only concern fields tandem leaves
unset (``managedBy``, immutability on update).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.deploy.paths import REPO

ENV = "TANDEM_KUBERAY_CRDS"
DEFAULT = REPO.parent / "shared" / "schemas" / "kuberay"

Schema = dict[str, Any]
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are 2 MB of YAML


def crd_paths() -> list[Path]:
    """The CRD files to read: ``$TANDEM_KUBERAY_CRDS`` or the workplace's copy."""
    entries = [Path(p) for p in os.environ.get(ENV, str(DEFAULT)).split(os.pathsep) if p]
    files: list[Path] = []
    for entry in entries:
        if not entry.exists():
            raise FileNotFoundError(
                f"KubeRay CRDs not found at {entry}: set {ENV} to the CRD files (or folders) of "
                "ray.io RayService and RayCluster, e.g. kuberay's ray-operator/config/crd/bases"
            )
        files += sorted(entry.glob("*.yaml")) if entry.is_dir() else [entry]
    return files


def to_json_schema(node: Schema) -> Schema:
    """One OpenAPI v3 structural schema node as JSON Schema (see the module docstring)."""
    out: Schema = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "not") or (key == "additionalProperties" and isinstance(value, dict)):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key != "nullable" and not key.startswith("x-kubernetes-"):
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    closed = "properties" in node and "additionalProperties" not in node
    if closed and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def load_schemas() -> dict[tuple[str, str], Schema]:
    """JSON Schemas by (apiVersion, kind), e.g. ("ray.io/v1", "RayService")."""
    schemas: dict[tuple[str, str], Schema] = {}
    for path in crd_paths():
        for doc in yaml.load_all(path.read_text(), Loader=_LOADER):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                api = f"{spec['group']}/{version['name']}"
                schema = to_json_schema(version["schema"]["openAPIV3Schema"])
                schemas[(api, spec["names"]["kind"])] = schema
    return schemas


def validate(manifest: dict[str, Any], schemas: dict[tuple[str, str], Schema]) -> None:
    """Raise ``jsonschema.ValidationError`` unless the manifest fits its CRD's schema."""
    key = (manifest["apiVersion"], manifest["kind"])
    if key not in schemas:
        raise LookupError(f"no CRD for {key} among {sorted(schemas)}")
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schemas[key]).iter_errors(manifest)
    )
    if error is not None:
        raise error
