"""Checkpoint families against transformers on tiny random checkpoints (fp32, ≤ 1e-4): Llama
3.x rotary scaling (``llama3``) and ``linear``, Llama with attention biases, Qwen2/2.5 (q/k/v
biases), Qwen3 (per-head q/k norms), Phi-3 (fused projections, its window), Gemma 3 (sliding
and global layers, each with its own rope), Qwen3-MoE and Mixtral (top-k routed experts),
gpt-oss (attention sinks, YaRN, biased experts and their clamped SwiGLU), Qwen2-MoE (a shared
expert), Mistral with and without its sliding window, most also over TP = 2; and every config
field that would change the math in a way tandem does not implement refused at load, naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from bench.family_checkpoints import FAMILIES, SHAPE
from bench.family_checkpoints import family_checkpoint as _checkpoint
from models.config import LlamaConfig
from models.kv_layout import kv_pool_shape
from models.spec import ModelSpec
from runtime.backends import model_backend
from runtime.runner import LocalRunner, SeqInput
from tests.helpers import assert_verification_equals_decodes
from tests.models.test_tensor_parallel import check_tp2_matches_tp1

TOL = 1e-4
BS = 16


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = _checkpoint(tmp_path / family, family)
    ours = ModelSpec(str(folder)).load()
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    c = ours.cfg
    pool = torch.zeros(kv_pool_shape(64, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    step = LocalRunner(ours, pool, BS).run
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    table = list(range(3, 3 + 19))
    out = step([SeqInput(table, 0, ids[:200], list(range(200)))])
    assert (out.logits - want[:200]).abs().max().item() <= TOL  # prefill
    pos = 200
    for n in (1, 1, 5):  # decode steps, then a verification of 4 drafts + 1
        out = step([SeqInput(table, pos, ids[pos : pos + n], list(range(n)))])
        assert (out.logits - want[pos : pos + n]).abs().max().item() <= TOL
        pos += n


@pytest.mark.parametrize(
    "family",
    [
        "qwen2",
        "llama-attention-bias",
        "qwen3",
        "phi3",
        "qwen3-moe",
        "qwen2-moe",
        "mixtral",
        "gemma3",
    ],
)
def test_families_split_over_tp2_match_tp1(tmp_path: Path, family: str) -> None:
    """Each rank keeps its slice of the q/k/v biases; the output projection's bias is added
        once, after the all-reduce; every rank normalizes its own heads with the shared per-head
        q/k norms; Phi-3's fused projections are split before each rank takes its slice; each expert
    is split like a dense MLP and a rank reduces its experts' sum once."""
    check_tp2_matches_tp1(ModelSpec(str(_checkpoint(tmp_path / family, family))))


@pytest.mark.parametrize("family", ["phi3", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verification_equals_decodes_bit_for_bit(tmp_path: Path, family: str, dtype: str) -> None:
    """As served on a CPU (Gemma 3: two attention plans a step, one per kind of layer)."""
    model = ModelSpec(str(_checkpoint(tmp_path / family, family)), dtype).load()
    c = model.cfg
    pool = torch.zeros(kv_pool_shape(8, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    served = model_backend(model, pool.to(model.dtype), BS)
    assert_verification_equals_decodes(model, n=60, k=15, blocks=8, backend=served)


BASE: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 32768,
}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "gpt_oss"}, "gpt_oss config has no num_experts_per_tok"),
        ({"model_type": "qwen3_moe"}, "no num_experts_per_tok"),
        ({"model_type": "mixtral", "num_experts_per_tok": 3, "num_local_experts": 2}, "1..2"),
        ({"model_type": "gemma2"}, "model_type 'gemma2'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "needs rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling.factor"),
        ({"mlp_bias": True}, "mlp_bias True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        ({"pretraining_tp": 2}, "pretraining_tp 2"),
        (
            {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True},
            "sliding_window 4096",
        ),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"quantization_config": {"quant_method": "fp8"}}, "weight_block_size None"),
        ({"quantization_config": {"quant_method": "hqq", "bits": 4}}, "quant_method 'hqq'"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 3}}, "bits 3 for gptq"),
        (
            {"quantization_config": {"quant_method": "compressed-tensors"}},
            "quantization_config: 1 validation error",  # which names config_groups
        ),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
        (
            {"model_type": "phi3", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
            "rope_type 'longrope'",
        ),
        (
            {"model_type": "phi3", "rope_parameters": {"partial_rotary_factor": 0.75}},
            "partial_rotary_factor 0.75",
        ),
        ({"model_type": "phimoe"}, "model_type 'phimoe'"),
        ({"embedding_multiplier": 12.0}, "embedding_multiplier 12.0"),
    ],
)
def test_fields_that_change_the_math_are_refused_by_name(
    change: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError) as e:
        LlamaConfig.from_hf_dict({**BASE, **change})
    assert named in str(e.value)


def test_what_does_not_change_the_math_is_accepted() -> None:
    """A Mistral whose window covers its whole context (or is off), a Qwen2 whose window is
    off, and explicit defaults: no window to honour."""
    for extra in (
        {"model_type": "mistral", "sliding_window": 32768},
        {"model_type": "mistral", "sliding_window": 4096, "use_sliding_window": False},
        {"model_type": "mistral", "sliding_window": None},
        {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False},
        {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "pretraining_tp": 1},
    ):
        cfg = LlamaConfig.from_hf_dict({**BASE, **extra})
        assert cfg.num_layers == 2 and cfg.sliding_window is None
    windowed = LlamaConfig.from_hf_dict({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert windowed.sliding_window == 4096  # honoured in attention


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int32, torch.int8])
def test_quantized_tensors_without_a_scheme_are_refused_by_name(
    tiny_folder: Path, tmp_path: Path, dtype: torch.dtype
) -> None:
    """A weight stored as fp8 or packed ints with no ``quantization_config`` is refused at load
    (a plain ``copy_`` into a float weight would convert it silently, without its scales)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_folder, folder)
    [file] = sorted(folder.glob("*.safetensors"))
    tensors = load_file(str(file))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        ModelSpec(str(folder)).load("cpu")
    assert name in str(e.value) and "quantization_config" in str(e.value)


def test_a_prequantized_checkpoint_is_refused_when_the_app_is_built(
    tiny_folder: Path, tmp_path: Path
) -> None:
    """Start-up, not the first request, names the method: the app builder reads the config."""
    import json
    import shutil

    from cluster.builder import resolve_models
    from cluster.config import TandemConfig

    folder = tmp_path / "hqq"
    shutil.copytree(tiny_folder, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "hqq", "bits": 4, "group_size": 128}
    (folder / "config.json").write_text(json.dumps(cfg))
    cfg_app = TandemConfig.model_validate({"model": {"source": str(folder)}, "mode": "colocated"})
    with pytest.raises(ValueError) as e:
        resolve_models(cfg_app)
    assert "quantization_config.quant_method 'hqq'" in str(e.value)


def test_a_multimodal_gemma3_folder_serves_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 4B and up ship as image-text checkpoints (``model_type: gemma3``, the language
    model under ``language_model.``): tandem serves the text part, as transformers' image-text
    model computes text-only prompts."""
    from transformers import AutoModelForImageTextToText, Gemma3Config

    _model_type, extra = FAMILIES["gemma3"]
    text = {**SHAPE, **extra, "vocab_size": 300}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                       image_token_index=299, boi_token_index=297, eoi_token_index=298)  # fmt: skip
    torch.manual_seed(5)
    ref = AutoModelForImageTextToText.from_config(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.08)
    ref.save_pretrained(tmp_path / "mm")
    ours = ModelSpec(str(tmp_path / "mm")).load()
    assert ours.cfg.gemma is not None and ours.cfg.vocab_size == 300
    ids = torch.randint(0, 296, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref.eval()(input_ids=torch.tensor([ids])).logits[0]
    c = ours.cfg
    pool = torch.zeros(kv_pool_shape(16, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    got = LocalRunner(ours, pool, BS).run([SeqInput(list(range(1, 9)), 0, ids, list(range(120)))])
    assert (got.logits - want).abs().max().item() <= TOL
