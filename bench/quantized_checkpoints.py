"""Tiny pre-quantized checkpoints written with the ``compressed-tensors`` library, as
llm-compressor writes them: a family's random checkpoint (``bench.families``), a preset scheme
applied to its matmuls (``lm_head`` ignored), weight scales from each weight's own range (the
minmax observer's result), compressed in the scheme's format and saved with its config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bench.family_checkpoints import family_checkpoint

GROUP = 32  # group size of the grouped schemes (the tiny models' rows are 64 or 128 wide)
SCHEMES: dict[str, dict[str, Any]] = {
    # weight-only: int8 per channel, int4 per group (symmetric and with zero points)
    "w8a16": {"preset": "W8A16", "weights": {"strategy": "channel", "group_size": None}},
    "w4a16": {"preset": "W4A16", "weights": {"group_size": GROUP}},
    "w4a16-asym": {"preset": "W4A16_ASYM", "weights": {"group_size": GROUP}},
    # activations quantized too: fp8 per channel with per-token inputs; fp8 per tensor with a
    # calibrated input scale; int8 per channel with per-token inputs
    "fp8-dynamic": {"preset": "FP8_DYNAMIC"},
    "fp8-static": {"preset": "FP8"},
    "w8a8-int8": {"preset": "W8A8"},
}
WEIGHT_ONLY = ("w8a16", "w4a16", "w4a16-asym")


def _scheme(name: str) -> Any:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    spec = SCHEMES[name]
    args = dict(PRESET_SCHEMES[spec["preset"]])
    if "weights" in spec:
        args["weights"] = QuantizationArgs(**{**args["weights"].model_dump(), **spec["weights"]})
    return QuantizationScheme(targets=["Linear"], **args)


def _input_ranges(model: Any, inputs: torch.Tensor) -> dict[str, float]:
    """Each linear's largest input magnitude over one forward of the unquantized model."""
    seen: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):

            def hook(_m: Any, args: tuple[torch.Tensor, ...], name: str = name) -> None:
                seen[name] = max(seen.get(name, 0.0), float(args[0].abs().amax()))

            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(inputs)
    for h in hooks:
        h.remove()
    return seen


def _calibrate(model: Any, ranges: dict[str, float]) -> None:
    """Each weight's scale from its range (symmetric: its largest magnitude); static input
    scales from the inputs' largest magnitude (fp8: over 448)."""
    from compressed_tensors.quantization.utils import calculate_qparams

    for name, m in model.named_modules():
        scheme = getattr(m, "quantization_scheme", None)
        if scheme is None:
            continue
        w, a = m.weight.data, scheme.weights
        if a.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif a.strategy == "group":
            g = w.view(w.shape[0], -1, a.group_size)
            lo, hi = g.amin(2), g.amax(2)
        else:
            lo, hi = w.amin().view(1), w.amax().view(1)
        scale, zero = calculate_qparams(lo, hi, a)
        m.weight_scale.data.copy_(scale.view(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.view(m.weight_zero_point.shape))
        act = scheme.input_activations
        if act is not None and not act.dynamic:
            top = torch.tensor([ranges[name]])
            scale, _ = calculate_qparams(-top, top, act)
            m.input_scale.data.copy_(scale.view(m.input_scale.shape))


def compressed_checkpoint(
    folder: Path,
    family: str,
    scheme: str,
    vocab_size: int = 256,
    tokenizer_from: Path | None = None,
) -> Path:
    """``family``'s tiny checkpoint quantized by ``scheme`` (a key of SCHEMES) into ``folder``."""
    dense = family_checkpoint(
        folder.with_name(folder.name + "-dense"), family, vocab_size, tokenizer_from
    )
    return compress(dense, folder, scheme)


def compress(dense: Path, folder: Path, scheme: str) -> Path:
    """The transformers checkpoint in ``dense`` quantized by ``scheme`` into ``folder``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    vocab_size = model.config.vocab_size
    ids = torch.randint(0, vocab_size, (1, 64), generator=torch.Generator().manual_seed(9))
    ranges = _input_ranges(model, ids)
    config = QuantizationConfig(config_groups={"group_0": _scheme(scheme)}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    _calibrate(model, ranges)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    for f in dense.iterdir():  # the tokenizer's files, if any
        if f.suffix in (".json", ".jinja") and not (folder / f.name).exists():
            (folder / f.name).write_bytes(f.read_bytes())
    assert "quantization_config" in json.loads((folder / "config.json").read_text())
    return folder


def block_fp8_checkpoint(
    folder: Path,
    family: str,
    block: tuple[int, int] = (32, 32),
    vocab_size: int = 256,
    tokenizer_from: Path | None = None,
) -> Path:
    """``family``'s tiny checkpoint in the block-wise fp8 format Qwen and DeepSeek publish
    (``quant_method: fp8``; no library writes it): each matmul but ``lm_head`` as e4m3 with one
    ``weight_scale_inv`` (its block's largest magnitude over 448) per ``block``."""
    from safetensors.torch import load_file, save_file

    dense = family_checkpoint(folder, family, vocab_size, tokenizer_from)
    [file] = sorted(dense.glob("*.safetensors"))
    tensors = load_file(str(file))
    bo, bi = block
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors[name].float()
        out, n = w.shape
        blocks = w.view(out // bo, bo, n // bi, bi)
        scale = blocks.abs().amax((1, 3)).clamp(min=1e-12) / 448.0  # [out / bo, in / bi]
        q = (blocks / scale.view(out // bo, 1, n // bi, 1)).to(torch.float8_e4m3fn)
        tensors[name] = q.view(out, n)
        tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [bo, bi],
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def _pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[n, m] of 0..15 -> [n / 8, m] int32, row 8i + k in nibble k."""
    q = q.to(torch.int64).view(-1, 8, q.shape[1])
    shifts = torch.arange(0, 32, 4).view(1, 8, 1)
    return (q << shifts).sum(1).to(torch.int64).to(torch.int32, copy=True).view(-1, q.shape[2])


def _pack_columns(q: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[n, m] of 0..15 -> [n, m / 8] int32, nibble i of each eight holding column order[i]
    (AutoAWQ's packing loop)."""
    q = q.to(torch.int64).view(q.shape[0], -1, 8)
    nibbles = q[:, :, list(order)]
    shifts = torch.arange(0, 32, 4).view(1, 1, 8)
    packed = (nibbles << shifts).sum(2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def int4_checkpoint(
    folder: Path, family: str, method: str, group: int = GROUP, act_order: bool = False
) -> tuple[Path, dict[str, torch.Tensor]]:
    """``family``'s tiny checkpoint in GPTQ's (v1) or AWQ's int4 layout (no library here writes
    them), and each matmul's weights as the format means them, (q - zero) * scale, which the
    packing must not change. ``act_order``: GPTQ's g_idx assigns input columns to groups out of
    order."""
    from safetensors.torch import load_file, save_file

    dense = family_checkpoint(folder, family)
    [file] = sorted(dense.glob("*.safetensors"))
    tensors = load_file(str(file))
    meant: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors.pop(name).float().t()  # [in, out]
        n = w.shape[0]
        groups = torch.arange(n) // group
        if act_order:
            groups = groups[torch.randperm(n, generator=gen)]
        lo = torch.stack([w[groups == g].amin(0) for g in range(n // group)]).clamp(max=0)
        hi = torch.stack([w[groups == g].amax(0) for g in range(n // group)]).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)  # [in / g, out]
        zero = (-lo / scale).round().clamp(0, 15)
        q = (w / scale[groups] + zero[groups]).round().clamp(0, 15)
        module = name.removesuffix(".weight")
        if method == "awq":
            tensors[f"{module}.qweight"] = _pack_columns(q, (0, 2, 4, 6, 1, 3, 5, 7))
            tensors[f"{module}.qzeros"] = _pack_columns(zero, (0, 2, 4, 6, 1, 3, 5, 7))
        else:
            tensors[f"{module}.qweight"] = _pack_rows(q)
            tensors[f"{module}.qzeros"] = _pack_columns(zero - 1, tuple(range(8)))  # v1: zero - 1
            tensors[f"{module}.g_idx"] = groups.to(torch.int32)
        tensors[f"{module}.scales"] = scale.to(torch.float16)
        meant[name] = ((q - zero[groups]) * scale.to(torch.float16).float()[groups]).t()
    save_file(tensors, str(file), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = (
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "version": "gemm",
            "zero_point": True,
        }
        if method == "awq"
        else {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": act_order,
            "sym": False,
        }
    )
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder, meant
