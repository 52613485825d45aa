"""Pre-quantized ``compressed-tensors`` checkpoints (the format llm-compressor writes: RedHat's
``*-quantized.w8a16`` / ``w4a16`` / ``FP8-dynamic`` families). Each quantized weight is
decompressed by the library's own compressor as it loads (weight-only formats then compute as
the dense model transformers decompresses them into); a format whose activations are
quantized (W8A8) also gets an ``InputQuant`` per matmul, applied the library's way."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.prequantized import PrequantizedCheckpoint, whole_tensor
from models.quant import Quant
from models.weights import Sliceable, lazy_tensors

FORMATS = ("int-quantized", "pack-quantized", "float-quantized", "naive-quantized")
# the HF matmuls whose input a tandem matmul quantizes (fused parts share their input)
INPUT_OF = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def _ct() -> Any:
    try:
        import compressed_tensors.quantization as ct
    except ImportError as e:  # a dependency of tandem: only a broken install lacks it
        raise ValueError(
            "compressed-tensors checkpoints need the compressed-tensors package"
        ) from e
    return ct


def check_config(qcfg: dict[str, Any]) -> Any:
    """The validated ``QuantizationConfig``; ValueError naming what tandem does not load."""
    ct = _ct()
    try:
        cfg = ct.QuantizationConfig.model_validate(qcfg)
    except ValueError as e:  # pydantic's, naming the field
        raise ValueError(f"invalid compressed-tensors quantization_config: {e}") from e
    if cfg.kv_cache_scheme is not None:
        raise ValueError("unsupported quantization_config.kv_cache_scheme: KV-cache quantization")
    if qcfg.get("transform_config"):
        raise ValueError("unsupported quantization_config.transform_config (rotations)")
    if qcfg.get("sparsity_config"):
        raise ValueError("unsupported quantization_config.sparsity_config")
    for name, scheme in cfg.config_groups.items():
        fmt = getattr(scheme, "format", None) or cfg.format
        where = f"quantization_config.config_groups.{name}"
        if fmt not in FORMATS:
            raise ValueError(f"unsupported {where} format {fmt!r}: tandem loads {list(FORMATS)}")
        w = scheme.weights
        if w is None or (w.type, w.num_bits) not in (("int", 4), ("int", 8), ("float", 8)):
            raise ValueError(f"unsupported {where}.weights: int4, int8 or fp8 weights only")
        if w.strategy not in ("channel", "group", "tensor"):
            raise ValueError(f"unsupported {where}.weights.strategy {w.strategy!r}")
        a = scheme.input_activations
        if a is not None and (
            a.num_bits != 8 or a.strategy not in ("token", "tensor") or a.dynamic == "local"
        ):
            raise ValueError(
                f"unsupported {where}.input_activations: 8-bit per token or per tensor only"
            )
        if scheme.output_activations is not None:
            raise ValueError(f"unsupported {where}.output_activations")
        for target in scheme.targets:
            if target != "Linear" and not target.startswith("re:") and "." not in target:
                raise ValueError(f"unsupported {where}.targets entry {target!r}")
    return cfg


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern in ("Linear", name)


@dataclass(frozen=True)
class InputQuant:
    """Quantize-dequantize of a matmul's input ``[T, in]`` as the format's
    ``input_activations`` say: per token (dynamic) or with a stored per-tensor scale."""

    args: Any  # compressed_tensors QuantizationArgs
    scale: torch.Tensor | None  # static: [1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ct = _ct()
        rows = x.unsqueeze(0)  # [1, T, in]: the library's token axis is dim 1
        if self.scale is None:
            scale, zero = ct.utils.compute_dynamic_scales_and_zp(rows, self.args, module=None)
        else:
            scale = self.scale.to(x.device)
            zero = torch.zeros_like(scale)
        out: torch.Tensor = ct.fake_quantize(rows, scale, zero, self.args)
        return out.squeeze(0)


class CompressedCheckpoint(PrequantizedCheckpoint):
    """A folder's tensors under their dense names: a quantized module's ``weight`` decompressed
    (float32) when read, everything else as stored."""

    def __init__(self, folder: Path, qcfg: dict[str, Any]) -> None:
        self.config = check_config(qcfg)
        self._raw = lazy_tensors(folder)
        self.quantized = frozenset(
            n.rsplit(".", 1)[0]
            for n in self._raw
            if n.endswith((".weight_scale", ".weight_packed"))
        )
        self._dense = {n for n in self._raw if not self._compressed_part(n)}
        self._dense |= {m + ".weight" for m in self.quantized}

    def kernel_quant(self) -> Quant:
        """INT8 for int8 weights per channel, symmetric, weight-only (W8A16); FP8 for fp8
        weights per channel with inputs per token (FP8_DYNAMIC); else NONE."""
        kinds = set()
        for scheme in self.config.config_groups.values():
            w, a = scheme.weights, scheme.input_activations
            per_channel = w.strategy == "channel" and w.symmetric
            if per_channel and (w.type, w.num_bits) == ("int", 8) and a is None:
                kinds.add(Quant.INT8)
            elif per_channel and w.type == "float" and a is not None and a.strategy == "token":
                kinds.add(Quant.FP8)
            else:
                kinds.add(Quant.NONE)
        return kinds.pop() if len(kinds) == 1 else Quant.NONE

    def scheme(self, module: str) -> Any | None:
        """The scheme that quantizes HF matmul ``module`` (e.g. ``model.layers.0.mlp.up_proj``)."""
        if any(_matches(p, module) for p in self.config.ignore or ()):
            return None
        for scheme in self.config.config_groups.values():
            if any(_matches(t, module) for t in scheme.targets):
                return scheme
        return None

    def _compressed_part(self, name: str) -> bool:
        base, _, leaf = name.rpartition(".")
        return leaf.startswith(("weight", "input_")) and base in self.quantized

    def __getitem__(self, name: str) -> Sliceable:
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in self.quantized:
            return self._decompress(module)
        if name not in self._dense:
            raise KeyError(name)
        return self._raw[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._dense))

    def __len__(self) -> int:
        return len(self._dense)

    def _decompress(self, module: str) -> torch.Tensor:
        from compressed_tensors.compressors import BaseCompressor

        scheme = self.scheme(module)
        if scheme is None:
            raise ValueError(f"{module} is stored quantized but no config group targets it")
        fmt = getattr(scheme, "format", None) or self.config.format
        parts = {
            leaf: whole_tensor(t)
            for n, t in self._raw.items()
            if (leaf := n.removeprefix(module + ".")) != n
            and "." not in leaf
            and leaf.startswith("weight")
        }
        dense: torch.Tensor = BaseCompressor.get_value_from_registry(fmt).decompress(parts, scheme)[
            "weight"
        ]
        return dense.float()

    def quantizes_input(self, module: str) -> bool:
        scheme = self.scheme(module)
        return scheme is not None and scheme.input_activations is not None

    def input_quant(self, layer_prefix: str, matmul: str) -> InputQuant | None:
        """The input quantization of tandem matmul ``matmul`` (a key of INPUT_OF) in the layer
        at ``layer_prefix``; a static scale shared by fused parts is their largest (as vLLM)."""
        found: list[tuple[Any, torch.Tensor | None]] = []
        for part in (matmul, *INPUT_OF[matmul]):  # Phi-3 stores qkv_proj and gate_up_proj
            module = next(
                (
                    f"{layer_prefix}{block}.{part}"
                    for block in ("self_attn", "mlp")
                    if f"{layer_prefix}{block}.{part}.weight" in self
                ),
                None,
            )
            scheme = None if module is None else self.scheme(module)
            if scheme is None or scheme.input_activations is None:
                continue
            stored = self._raw.get(f"{module}.input_scale")
            found.append(
                (scheme.input_activations, None if stored is None else whole_tensor(stored))
            )
        if not found:
            return None
        args = found[0][0]
        static = [s for _, s in found if s is not None]
        return InputQuant(args, torch.stack(static).amax().reshape(1).float() if static else None)
