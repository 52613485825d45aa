"""Pre-quantized compressed-tensors checkpoints, written with the library
(``bench.quantized_checkpoints``), served as stored: weight-only formats (int8 per channel, int4
per group) within 1e-4 of transformers (which decompresses them too), also over TP = 2 and for
Phi-3's fused projections; int4 with zero points (which transformers 5.25 cannot load) against
the dense weights quantized by hand; the W8A8 formats (fp8 per token, fp8 with a static input
scale, int8 per token) against a reference written here: the dequantized weights, each matmul's
input quantized as the format says; and what tandem does not load refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from bench.quantized_checkpoints import GROUP, WEIGHT_ONLY, compressed_checkpoint
from models.config import LlamaConfig
from models.kv_layout import kv_pool_shape
from models.spec import ModelSpec
from runtime.runner import LocalRunner, SeqInput
from tests.models.test_tensor_parallel import check_tp2_matches_tp1

BS = 16
IDS = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()


def _ours(folder: Path) -> torch.Tensor:
    """[150, V] logits: a 120-token prompt, then decodes and a 5-token verification."""
    model = ModelSpec(str(folder)).load()
    c = model.cfg
    pool = torch.zeros(kv_pool_shape(16, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    step = LocalRunner(model, pool, BS).run
    table = list(range(1, 11))
    out = [step([SeqInput(table, 0, IDS[:120], list(range(120)))]).logits]
    pos = 120
    for n in (1, 1, 5, 23):
        out.append(step([SeqInput(table, pos, IDS[pos : pos + n], list(range(n)))]).logits)
        pos += n
    return torch.cat(out)


def _transformers(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(torch.tensor([IDS])).logits[0]


@pytest.mark.parametrize(
    ("family", "scheme"), [("qwen3", s) for s in WEIGHT_ONLY[:2]] + [("phi3", "w4a16")]
)
def test_weight_only_formats_match_transformers(tmp_path: Path, family: str, scheme: str) -> None:
    folder = compressed_checkpoint(tmp_path / scheme, family, scheme)
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "pack-quantized"
    got, want = _ours(folder), _transformers(folder)
    assert (got - want).abs().max().item() <= 1e-4
    dense = _transformers(folder.with_name(folder.name + "-dense"))
    assert (got - dense).abs().max().item() > 1e-4  # the quantization is there to see


def test_a_grouped_int4_checkpoint_splits_over_tp2(tmp_path: Path) -> None:
    check_tp2_matches_tp1(ModelSpec(str(compressed_checkpoint(tmp_path / "q", "qwen3", "w4a16"))))


def _fake_int4(w: torch.Tensor) -> torch.Tensor:
    """Asymmetric int4 per group of GROUP columns, by hand: scale = range / 15, zero point
    rounded into [-8, 7], q = clamp(round(w / scale + zp)), w' = (q - zp) * scale."""
    g = w.view(w.shape[0], -1, GROUP)
    lo = g.amin(2, keepdim=True).clamp(max=0)
    hi = g.amax(2, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 15
    zp = (-8 - lo / scale).clamp(-8, 7).round()
    q = (g / scale + zp).round().clamp(-8, 7)
    return ((q - zp) * scale).view_as(w)


def test_int4_with_zero_points_matches_the_weights_quantized_by_hand(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = compressed_checkpoint(tmp_path / "asym", "qwen3", "w4a16-asym")
    ref = AutoModelForCausalLM.from_pretrained(folder.with_name("asym-dense"), dtype=torch.float32)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                m.weight.copy_(_fake_int4(m.weight))
        want = ref.eval()(torch.tensor([IDS])).logits[0]
    assert (_ours(folder) - want).abs().max().item() <= 1e-4


def _stored(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """By hand from the files: each quantized matmul's weight times its scale (per channel or
    per tensor), and each static input scale."""
    tensors: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - not a dict
    weights = {
        k.removesuffix("_scale"): tensors[k.removesuffix("_scale")].float() * v.float()
        for k, v in tensors.items()
        if k.endswith(".weight_scale")
    }
    inputs = {
        k.removesuffix(".input_scale"): v for k, v in tensors.items() if k.endswith(".input_scale")
    }
    return weights, inputs


def _quantize_input(x: torch.Tensor, scheme: str, static: torch.Tensor | None) -> torch.Tensor:
    """The format's activation quantization, by hand: fp8 e4m3 (per token, or a static scale)
    or int8 per token; a per-token scale is the row's largest magnitude over half the range."""
    if scheme == "w8a8-int8":
        s = x.abs().amax(-1, keepdim=True) / 127.5
        return (x / s).round().clamp(-128, 127) * s
    s = x.abs().amax(-1, keepdim=True) / 448.0 if static is None else static
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


@pytest.mark.parametrize("scheme", ["fp8-dynamic", "fp8-static", "w8a8-int8"])
def test_activation_quantized_formats_match_their_reference(tmp_path: Path, scheme: str) -> None:
    from transformers import AutoModelForCausalLM

    folder = compressed_checkpoint(tmp_path / scheme, "qwen3", scheme)
    ref = AutoModelForCausalLM.from_pretrained(
        folder.with_name(f"{scheme}-dense"), dtype=torch.float32
    )
    weights, statics = _stored(folder)
    assert len(weights) == 14 and not ref.load_state_dict(weights, strict=False).unexpected_keys
    assert bool(statics) == (scheme == "fp8-static")

    def hook(name: str) -> Any:
        return lambda _m, args: (_quantize_input(args[0], scheme, statics.get(name)),)

    for name, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            m.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        want = ref.eval()(torch.tensor([IDS])).logits[0]
    got = _ours(folder)
    assert (got - want).abs().max().item() <= 1e-4
    served = ModelSpec(str(folder)).load()
    assert all(
        m.input_quant is not None for n, m in served.named_modules() if n.endswith("qkv_proj")
    )


BASE = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip


def _ct(group: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**BASE, "quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], **group}}, **extra}}  # fmt: skip


W4 = {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (_ct(W4, format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized'"),
        (_ct(W4, format="marlin-24"), "format 'marlin-24'"),
        (_ct(W4, kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (_ct({"weights": {"num_bits": 2, "type": "int"}}), "int4, int8 or fp8 weights only"),
        (
            _ct(
                {
                    **W4,
                    "input_activations": {
                        "num_bits": 8,
                        "type": "int",
                        "strategy": "group",
                        "group_size": 32,
                        "dynamic": True,
                    },
                }
            ),
            "input_activations",
        ),
        ({**BASE, "quantization_config": {"quant_method": "bitsandbytes"}}, "'bitsandbytes'"),
        ({**BASE, "quantization_config": {"quant_method": "mxfp4"}}, "'mxfp4'"),
        ({**BASE, "quantization_config": {"quant_method": "eetq"}}, "'eetq'"),
    ],
)
def test_what_tandem_does_not_load_is_refused_by_name(config: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError) as e:
        LlamaConfig.from_hf_dict(config)
    assert named in str(e.value)


def test_requantizing_a_prequantized_checkpoint_is_refused(tmp_path: Path) -> None:
    folder = compressed_checkpoint(tmp_path / "q", "qwen3", "w8a16")
    with pytest.raises(ValueError, match="pre-quantized checkpoint"):
        ModelSpec(str(folder), quantization="int8").load()


@pytest.mark.parametrize(
    ("scheme", "kind"),
    [("w8a16", "int8"), ("fp8-dynamic", "fp8"), ("w4a16", "none"), ("fp8-static", "none")],
)
def test_a_gpu_serves_the_stored_kind_in_tandems_kernels(
    tmp_path: Path, scheme: str, kind: str
) -> None:
    """W8A16 (int8 per channel) and FP8_DYNAMIC (fp8 per channel, inputs per token) are the
    formats tandem's own int8 and fp8 kernels compute: on a GPU they serve in them; the dense
    weights quantized again per row give the stored codes back (fp8 exactly, int8 within one
    step, its scale being stored in bf16); a CPU serves every format dequantized (exact)."""
    from models.checkpoint import open_weights
    from models.prequantized import PrequantizedCheckpoint
    from models.quant import Quant, quantize, row_absmax
    from models.spec import served_kernel

    folder = compressed_checkpoint(tmp_path / scheme, "qwen3", scheme)
    weights = open_weights(folder)
    assert isinstance(weights, PrequantizedCheckpoint)
    assert weights.kernel_quant() is Quant(kind)
    assert served_kernel(weights, "cpu") is Quant.NONE
    if kind == "none":
        return
    name = "model.layers.1.mlp.down_proj"
    dense = weights[name + ".weight"].narrow(0, 0, 64)
    again = quantize(dense, Quant(kind), row_absmax(dense))
    if kind == "fp8":
        with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as h:
            assert torch.equal(again.data.float(), h.get_tensor(name + ".weight").float())
    else:
        step = again.scale.float().unsqueeze(1)
        assert (again.data.float() * step - dense).abs().le(step).all()
