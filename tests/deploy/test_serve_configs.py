"""The Serve config files load through Ray Serve's own schema, embed a valid app config, and
size each pool and the ingress the way the app builder does."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from ray.serve._private.build_app import build_app as serve_build_app
from ray.serve._private.deploy_utils import get_app_code_version
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
from ray.serve.schema import ServeDeploySchema

from cluster.builder import app_builder, build_app
from cluster.config import TandemConfig
from cluster.render import IMPORT_PATH, serve_config
from tests.deploy.paths import DEPLOY, load_yaml, serve_files


def _app(doc: dict[str, Any]) -> dict[str, Any]:
    (app,) = doc["applications"]
    return dict(app)


@pytest.mark.parametrize("path", serve_files(), ids=lambda p: p.name)
def test_serve_config_loads_through_ray_serve_schema(path: Path) -> None:
    doc = load_yaml(path)
    schema = ServeDeploySchema.model_validate(doc)
    (app,) = schema.applications
    assert app.import_path == IMPORT_PATH and app.route_prefix == "/"
    cfg = TandemConfig.model_validate(app.args["config"])
    expected = {"ingress", "decode"} | ({"prefill"} if cfg.mode == "disaggregated" else set())
    assert {d.name for d in app.deployments} == expected
    for d in app.deployments:
        if isinstance(d.autoscaling_config, dict):  # Serve validates it only at deploy time
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # Serve warns of what it will refuse later
                ServeAutoscalingConfig(**d.autoscaling_config)


def test_import_path_is_the_app_builder() -> None:
    module, attr = IMPORT_PATH.split(":")
    imported = getattr(__import__(module, fromlist=[attr]), attr)
    assert imported is app_builder


def test_every_mode_and_pool_layout_is_shipped() -> None:
    docs = {p.stem: _app(load_yaml(p)) for p in serve_files()}
    modes = {TandemConfig.model_validate(a["args"]["config"]).mode for a in docs.values()}
    assert modes == {"colocated", "disaggregated"}
    gpu = docs["gpu-disaggregated"]
    cfg = TandemConfig.model_validate(gpu["args"]["config"])
    assert cfg.prefill.device == cfg.decode.device == "cuda"  # 'auto' would resolve on the head
    pools = [d for d in gpu["deployments"] if d["name"] != "ingress"]
    assert pools and all("autoscaling_config" in d for d in pools)
    (ingress,) = [d for d in gpu["deployments"] if d["name"] == "ingress"]
    # sized for the decode pool at its largest: no ingress cap below what decode can run
    full = TandemConfig.from_yaml(DEPLOY / "apps" / "gpu-disaggregated.yaml")
    streams = full.decode.most_replicas() * full.decode.max_batch_size
    assert ingress["num_replicas"] * cfg.limits.max_inflight >= streams > 1 * 256


def test_pool_sizing_changes_keep_the_code_version(tmp_path: Path) -> None:
    """Serve restarts every replica when an application's code version changes; sizing must not."""
    source = (DEPLOY / "apps" / "gpu-disaggregated.yaml").read_text()

    def version(text: str) -> str:
        path = tmp_path / "app.yaml"
        path.write_text(text)
        doc = serve_config(TandemConfig.from_yaml(path))
        return get_app_code_version(ServeDeploySchema.model_validate(doc).applications[0])

    base = version(source)
    resized = source.replace("max_replicas: 32", "max_replicas: 40").replace(
        "target_ongoing_requests: 48", "target_ongoing_requests: 40"
    )
    assert resized != source and version(resized) == base
    other_model = source.replace("num_speculative_tokens: 4", "num_speculative_tokens: 6")
    assert other_model != source and version(other_model) != base


def test_gpu_autoscaling_targets_suit_each_phase() -> None:
    cfg = TandemConfig.from_yaml(DEPLOY / "apps" / "gpu-disaggregated.yaml")
    prefill, decode = cfg.prefill.autoscaling, cfg.decode.autoscaling
    assert prefill is not None and decode is not None
    # A prefill replica runs one prompt at a time: scale once prompts queue, quickly.
    assert prefill.target_ongoing_requests <= 4
    assert prefill.upscale_delay_s < decode.upscale_delay_s
    # A decode replica batches its streams: scale on streams, below the batch size.
    assert cfg.decode.max_batch_size / 4 <= decode.target_ongoing_requests
    assert decode.target_ongoing_requests <= cfg.decode.max_batch_size
    assert decode.min_replicas >= 1


@pytest.mark.parametrize("name", ["local-colocated", "gpu-disaggregated"])
def test_builder_sizes_pools_as_the_serve_config_does(
    embedded_folder: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tandem serve` and `serve run ...:app_builder config=FILE` size pools like the file
    (given a key: the files are closed by default)."""
    monkeypatch.setenv("TANDEM_API_KEYS", "sk-tandem-config-test-key-1")
    overrides = _app(load_yaml(DEPLOY / "serve" / f"{name}.yaml"))["deployments"]
    # The GPU models are not on this machine: same pools and sizing, the embedded model.
    cfg = TandemConfig.from_yaml(DEPLOY / "apps" / f"{name}.yaml").with_overrides(
        **{
            "model.source": "embedded",
            "draft.kind": "ngram",
            "draft.source": None,
            "draft.lookup_first": False,
        }
    )
    built = serve_build_app(build_app(cfg), name="tandem")
    deployments = {d.name: d for d in built.deployments}
    assert {o["name"] for o in overrides} == set(deployments)
    for override in overrides:
        d = deployments[override["name"]]
        assert d.max_ongoing_requests == override["max_ongoing_requests"]
        if d.name != "ingress":
            pool = cfg.decode if d.name == "decode" else cfg.prefill
            assert d.ray_actor_options["resources"] == {pool.resource: float(pool.tp)}
            gpus = pool.tp if pool.device == "cuda" else 0
            assert d.ray_actor_options.get("num_gpus", 0) == gpus
        scaling = d._deployment_config.autoscaling_config
        if "autoscaling_config" in override:
            assert scaling is not None
            want = ServeAutoscalingConfig(**override["autoscaling_config"])
            assert scaling.model_dump() == want.model_dump()
        else:
            assert scaling is None and d.num_replicas == override["num_replicas"]
