from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.builder import DraftMismatchError, check_draft_vocab, resolve_models
from cluster.cli import _load_config, build_parser
from cluster.cli import main as cli_main
from cluster.config import TandemConfig
from models.spec import served_dtype

REPO = Path(__file__).resolve().parents[2]


def test_local_yaml_loads() -> None:
    cfg = TandemConfig.from_yaml(REPO / "deploy" / "local.yaml")
    assert cfg.mode == "disaggregated" and cfg.draft.kind == "eagle" and cfg.draft.lookup_first
    assert cfg.draft.source == "embedded"  # the head shipped with tandem
    assert cfg.local_resources() == {"decode_pool": 1.0, "prefill_pool": 1.0}


@pytest.mark.parametrize(
    "path", sorted((REPO / "bench" / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_bench_configs_load(path: Path) -> None:
    cfg = TandemConfig.from_yaml(path)
    assert cfg.decode.routing != "slo_aware" or cfg.decode.routing_tpot_slo_s is not None


def _cli(*argv: str) -> TandemConfig:
    return _load_config(build_parser().parse_args(["serve", *argv]))


def test_cli_draft_override_drops_the_configs_head() -> None:
    """README's `tandem serve --config deploy/local.yaml --mode colocated --draft none`."""
    cfg = _cli(
        "--config", str(REPO / "deploy" / "local.yaml"), "--mode", "colocated", "--draft", "none"
    )
    assert cfg.mode == "colocated" and cfg.draft.kind == "none"
    assert cfg.draft.source is None and not cfg.draft.lookup_first


def test_cli_flags_and_set_reach_the_config() -> None:
    cfg = _cli(
        "--model", "/models/x", "--dtype", "bfloat16", "--tp", "2", "--quantization", "int8",
        "--max-model-len", "4096", "--draft", "eagle", "--draft-source", "/heads/x",
        "--set", "decode.num_blocks=4096", "--set", "draft.tree_width=4",
        "--set", "decode.max_batch_size=16", "--set", "limits.max_model_len=null",
    )  # fmt: skip
    assert (cfg.model.source, cfg.model.dtype, cfg.model.quantization) == (
        "/models/x",
        "bfloat16",
        "int8",
    )
    assert cfg.decode.tp == cfg.prefill.tp == 2
    assert (cfg.draft.kind, cfg.draft.source, cfg.draft.tree_width) == ("eagle", "/heads/x", 4)
    assert cfg.decode.num_blocks == 4096 and cfg.decode.max_batch_size == 16
    assert cfg.limits.max_model_len is None  # --set comes last: it overrides the flag
    assert TandemConfig().model.dtype == "auto"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--set", "decode.num_blockz=3"], "num_blockz"),
        (["--set", "decode.tp=0"], "decode.tp"),
        (["--tp", "0"], "tp"),
        (["--max-model-len", "1"], "max_model_len"),
        (["--draft", "eagle"], "draft.source"),
    ],
)
def test_cli_refuses_a_bad_setting_by_name_before_starting_anything(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and needle in err


def test_cli_set_wants_key_equals_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["serve", "--set", "decode.num_blocks"])
    assert stop.value.code == 2 and "--set wants key=value" in capsys.readouterr().err


def test_auto_dtype_is_float32_on_a_cpu_and_the_checkpoints_on_a_gpu(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert served_dtype("auto", tmp_path, "cpu") == "float32"
    assert served_dtype("auto", tmp_path, "cuda") == "bfloat16"
    assert served_dtype("float16", tmp_path, "cuda") == "float16"
    (tmp_path / "config.json").write_text('{"dtype": "float32"}')  # transformers 5's name
    assert served_dtype("auto", tmp_path, "cuda") == "float32"
    (tmp_path / "config.json").write_text("{}")
    assert served_dtype("auto", tmp_path, "cuda") == "bfloat16"


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"draft": {"kind": "draft_model"}}, "draft.source"),
        ({"draft": {"kind": "ngram", "source": "/x"}}, "only used with kind=draft_model"),
        ({"draft": {"kind": "ngram", "lookup_first": True}}, "lookup_first needs kind"),
        ({"draft": {"kind": "ngram", "tree_width": 4}}, "tree_width > 1 needs kind=eagle"),
        ({"draft": {"kind": "eagle", "source": "/x", "tree_width": 9}}, "tree_width"),
        ({"mode": "both"}, "mode"),
        ({"decode": {"tp": 0}}, "tp"),
        ({"kv": {"block_size": 0}}, "block_size"),
        ({"decode": {"num_blockz": 3}}, "num_blockz"),
        ({"decode": {"routing": "slo_aware"}}, "routing_tpot_slo_s is not set"),
        ({"decode": {"routing": "slo_aware", "routing_tpot_slo_s": 0}}, "routing_tpot_slo_s"),
        ({"decode": {"speculation_tpot_slo_s": -1}}, "speculation_tpot_slo_s"),
        ({"decode": {"speculation_tpot_slo_max_loss": 1.5}}, "speculation_tpot_slo_max_loss"),
        ({"decode": {"gpu_fraction": 0.5}}, "gpu_fraction=0.5 needs device: cuda"),
        ({"prefill": {"device": "cuda", "tp": 2, "gpu_fraction": 0.5}}, "needs tp 1"),
        ({"decode": {"device": "cuda", "gpu_fraction": 0}}, "gpu_fraction"),
        ({"decode": {"switch_interval_s": 0}}, "switch_interval_s"),
        ({"prefill": {"switch_interval_s": 1}}, "switch_interval_s"),
        (
            {"draft": {"adaptive": False}, "decode": {"speculation_tpot_slo_s": 0.05}},
            "speculation_tpot_slo_s is set but speculation is not adaptive",
        ),
        (
            {"draft": {"kind": "none"}, "decode": {"speculation_tpot_slo_s": 0.05}},
            "draft.kind=none",
        ),
        (
            {"ingress": {"replicas": 2, "autoscaling": {"max_replicas": 4}}},
            "either ingress.replicas",
        ),
        ({"ingress": {"replicas": 0}}, "ingress.replicas"),
        ({"logging": {"encoding": "XML"}}, "logging.encoding"),
    ],
)
def test_bad_config_names_the_field(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TandemConfig.model_validate(data)


def test_colocated_needs_no_prefill_pool() -> None:
    cfg = TandemConfig.model_validate({"mode": "colocated"})
    assert cfg.local_resources() == {"decode_pool": 1.0}


def test_draft_with_another_vocabulary_is_refused(embedded_folder: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.helpers import make_tiny_checkpoint

    draft = make_tiny_checkpoint(tmp_path, embedded_folder, seed=3)
    tok = AutoTokenizer.from_pretrained(draft)
    tok.add_tokens(["<only-in-the-draft>"])
    tok.save_pretrained(draft)
    with pytest.raises(
        DraftMismatchError, match=r"draft vocabulary .* differs from target vocabulary"
    ):
        check_draft_vocab(embedded_folder, draft)
    cfg = TandemConfig.model_validate({"draft": {"kind": "draft_model", "source": str(draft)}})
    with pytest.raises(DraftMismatchError, match=str(draft)):
        resolve_models(cfg)


def test_unknown_model_source_says_nothing_is_downloaded() -> None:
    cfg = TandemConfig.model_validate({"model": {"source": "nobody/no-such-model"}})
    with pytest.raises(FileNotFoundError, match="never downloads"):
        resolve_models(cfg)


def test_tp_must_divide_the_heads() -> None:
    cfg = TandemConfig.model_validate({"decode": {"tp": 2}})
    with pytest.raises(
        ValueError, match=r"decode.tp=2 does not divide the model's 9 attention heads"
    ):
        resolve_models(cfg)
    resolve_models(TandemConfig.model_validate({"decode": {"tp": 3}, "prefill": {"tp": 3}}))


def test_embedded_head_resolves_to_the_shipped_folder_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`draft.source: embedded` names the head inside the installed `models` package, so a Serve
    app built in another working directory (serve deploy, KubeRay) finds it too."""
    monkeypatch.chdir(tmp_path)
    cfg = TandemConfig.model_validate(
        {"draft": {"kind": "eagle", "source": "embedded", "lookup_first": True}}
    )
    models = resolve_models(cfg)
    assert models.draft.model is not None
    head = Path(models.draft.model.folder)
    assert head == REPO / "models" / "drafts" / "smollm2-135m-eagle"
    assert (head / "model.safetensors").is_file()
    relative = TandemConfig.model_validate(
        {"draft": {"kind": "eagle", "source": "models/drafts/smollm2-135m-eagle"}}
    )
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_models(relative)  # a relative path is relative to where the app is built


def test_object_store_transport_with_tp_is_refused_by_name() -> None:
    """The fallback moves KV between single ranks; with TP it used to be ignored silently."""
    with pytest.raises(ValidationError, match=r"kv.transport=object_store .* decode.tp is 3"):
        TandemConfig.model_validate({"kv": {"transport": "object_store"}, "decode": {"tp": 3}})
    ok = TandemConfig.model_validate({"kv": {"transport": "nixl"}, "decode": {"tp": 3}})
    assert ok.decode.tp == 3


def test_the_ingress_is_sized_for_what_decode_can_run() -> None:
    """One ingress replica per limits.max_inflight streams the decode pool can run at its
    largest, at least one; a set count or autoscaling wins."""
    assert TandemConfig().ingress_scaling() == {"num_replicas": 1}
    big = TandemConfig.model_validate(
        {"decode": {"max_batch_size": 64, "autoscaling": {"max_replicas": 9}}}
    )
    assert big.ingress_replicas() == 3  # 576 streams over 256 per ingress replica
    capped = big.with_overrides(**{"limits.max_inflight": 100})
    assert capped.ingress_replicas() == 6
    assert big.with_overrides(**{"ingress.replicas": 1}).ingress_scaling() == {"num_replicas": 1}
    scaled = big.with_overrides(**{"ingress.autoscaling": {"max_replicas": 5}})
    assert scaled.ingress_scaling()["autoscaling_config"]["max_replicas"] == 5


def test_logging_settings_are_serve_logging_configs() -> None:
    from ray.serve.schema import LoggingConfig

    cfg = TandemConfig.model_validate({"logging": {"encoding": "JSON", "level": "DEBUG"}})
    serve_cfg = LoggingConfig(**cfg.logging.serve_options())
    assert serve_cfg.encoding == "JSON" and serve_cfg.log_level == "DEBUG"
    assert serve_cfg.enable_access_log
