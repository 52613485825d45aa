"""The per-pool autoscaling section of the config: phase defaults, cross-field rules, and what
the app builder and the local cluster make of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as serve_build_app

from cluster.builder import app_builder
from cluster.config import TandemConfig

BOUNDS = {"min_replicas": 1, "max_replicas": 4}


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (
            {"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
            r"min_replicas \(3\) exceeds autoscaling.max_replicas \(2\)",
        ),
        (
            {"prefill": {"autoscaling": {**BOUNDS, "initial_replicas": 9}}},
            r"initial_replicas \(9\) must lie between",
        ),
        ({"prefill": {"autoscaling": {"min_replicas": 1}}}, "max_replicas"),
        (
            {"prefill": {"replicas": 2, "autoscaling": BOUNDS}},
            "either replicas .* or autoscaling",
        ),
        (
            {
                "prefill": {
                    "max_ongoing_requests": 4,
                    "autoscaling": {**BOUNDS, "target_ongoing_requests": 8},
                }
            },
            r"target_ongoing_requests \(8\) exceeds max_ongoing_requests \(4\)",
        ),
        (
            {"decode": {"max_batch_size": 16, "autoscaling": BOUNDS}},
            r"target_ongoing_requests \(32\) exceeds decode.max_batch_size \(16\)",
        ),
        (
            {"decode": {"autoscaling": {"min_replicas": 0, "max_replicas": 2}}},
            "min_replicas must be at least 1 in disaggregated mode",
        ),
        ({"decode": {"autoscaling": {**BOUNDS, "look_back_period_s": 5}}}, "look_back_period_s"),
        ({"decode": {"autoscaling": {**BOUNDS, "target_replicas": 2}}}, "target_replicas"),
    ],
)
def test_bad_autoscaling_names_the_problem(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TandemConfig.model_validate(data)


def test_each_phase_gets_its_own_default_targets() -> None:
    cfg = TandemConfig.model_validate(
        {"prefill": {"autoscaling": BOUNDS}, "decode": {"autoscaling": BOUNDS}}
    )
    prefill, decode = cfg.prefill.autoscaling, cfg.decode.autoscaling
    assert prefill is not None and decode is not None
    assert (
        prefill.target_ongoing_requests
        < decode.target_ongoing_requests
        <= cfg.decode.max_batch_size
    )
    assert prefill.upscale_delay_s < decode.upscale_delay_s
    assert prefill.look_back_period_s < decode.look_back_period_s


def test_scale_to_zero_is_allowed_where_nothing_waits_on_the_pool() -> None:
    zero = {"min_replicas": 0, "max_replicas": 2}
    cfg = TandemConfig.model_validate({"mode": "colocated", "decode": {"autoscaling": zero}})
    assert cfg.decode.scaling_options()["autoscaling_config"]["min_replicas"] == 0
    cfg = TandemConfig.model_validate({"prefill": {"autoscaling": zero}})
    assert cfg.prefill.most_replicas() == 2


def test_sizing_options_are_a_count_or_an_autoscaling_config() -> None:
    cfg = TandemConfig.model_validate(
        {"prefill": {"replicas": 3}, "decode": {"autoscaling": BOUNDS}}
    )
    assert cfg.prefill.scaling_options() == {"num_replicas": 3}
    scaling = cfg.decode.scaling_options()["autoscaling_config"]
    assert scaling["max_replicas"] == 4 and scaling["target_ongoing_requests"] == 32.0
    assert "upscaling_factor" not in scaling  # unset optionals leave Serve's defaults
    # A local cluster offers enough of each pool for the most replicas it may run.
    assert cfg.local_resources() == {"prefill_pool": 3.0, "decode_pool": 4.0}


def test_overrides_keep_an_autoscaled_pool_valid() -> None:
    cfg = TandemConfig.model_validate({"decode": {"autoscaling": BOUNDS}})
    moved = cfg.with_overrides(**{"http.port": 9001, "decode.num_blocks": 64})
    assert moved.http.port == 9001 and moved.decode.num_blocks == 64
    assert moved.decode.autoscaling == cfg.decode.autoscaling


def test_app_builder_takes_the_config_inline_or_as_a_file(
    embedded_folder: Path, tmp_path: Path
) -> None:
    inline = {
        "mode": "colocated",
        "auth": {"required": False},
        "decode": {
            "num_blocks": 32,
            "autoscaling": {"max_replicas": 3, "target_ongoing_requests": 4},
        },
    }
    built = serve_build_app(app_builder({"config": inline}), name="tandem")
    decode = next(d for d in built.deployments if d.name == "decode")
    assert decode._deployment_config.autoscaling_config is not None
    assert decode._deployment_config.autoscaling_config.max_replicas == 3
    path = tmp_path / "app.yaml"
    path.write_text(
        "mode: colocated\nauth:\n  required: false\ndecode:\n  replicas: 2\n  num_blocks: 32\n"
    )
    built = serve_build_app(app_builder({"config": str(path)}), name="tandem")
    assert next(d for d in built.deployments if d.name == "decode").num_replicas == 2
    with pytest.raises(ValueError, match=r"unknown application args \['confg'\]"):
        app_builder({"confg": str(path)})
