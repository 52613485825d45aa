"""Per-output-channel weight quantization: int8 weight-only (the CPU panel kernel, else
``_weight_int8pack_mm`` with bf16 activations) and fp8 e4m3 with per-token activation scales
(``torch._scaled_mm``, GPUs of compute capability >= 8.9). Scales are taken over whole rows
across a TP group, so every TP layout serves the same weights and exchanges the same KV."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0
_INT8_MAX = 127.0
# the int8 kernel's CPU path reads whole 16-column tiles; the fp8 matmul needs multiples of 16
_ALIGN = 16


class Quant(enum.Enum):
    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"


def check_supported(kind: Quant, device: torch.device | str) -> None:
    """Raises ValueError where the device cannot serve ``kind`` fast (fp8: CUDA, cc >= 8.9)."""
    dev = torch.device(device)
    if kind is not Quant.FP8:
        return
    if dev.type != "cuda":
        raise ValueError(
            f"quantization=fp8 needs a CUDA GPU of compute capability >= 8.9; this replica "
            f"runs on {dev.type} (use int8 there)"
        )
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"quantization=fp8 needs compute capability >= 8.9; {torch.cuda.get_device_name(dev)}"
            f" has {major}.{minor} (use int8 there)"
        )


def _activation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


@dataclass(frozen=True)
class QuantizedWeight:
    kind: Quant
    data: torch.Tensor  # [out, in] int8 or float8_e4m3fn
    scale: torch.Tensor  # [out]: the int8 kernel's activation dtype (int8), float32 (fp8)
    out_dtype: torch.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self._product(x)
        return y if bias is None else y + bias

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is Quant.INT8:
            a = x.to(self.scale.dtype)
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(a, self.data, self.scale)
            return y.to(self.out_dtype)
        xf = x.float()
        x_scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / _FP8_MAX
        xq = (xf / x_scale).to(FP8)
        y = torch._scaled_mm(
            xq,
            self.data.t(),
            scale_a=x_scale,
            scale_b=self.scale.view(1, -1),
            out_dtype=torch.bfloat16 if x.device.type == "cuda" else torch.float32,
        )  # CUDA's row-wise scaled matmul writes bf16 only
        return y.to(self.out_dtype)

    def dequantized(self) -> torch.Tensor:
        return self.data.float() * self.scale.float().unsqueeze(1)


def row_absmax(weight: torch.Tensor, group: Any = None) -> torch.Tensor:
    """[out] float32 row maxima of |weight| [out, in_local], over a TP ``group``'s columns."""
    m = weight.detach().abs().amax(dim=1).float()
    if group is not None:
        group.allreduce([m], torch.distributed.ReduceOp.MAX).wait()
    return m


def quantize(weight: torch.Tensor, kind: Quant, absmax: torch.Tensor) -> QuantizedWeight:
    if kind is Quant.NONE:
        raise ValueError("quantize() needs a quantization kind, not none")
    out_features, in_features = weight.shape
    if in_features % _ALIGN or (kind is Quant.FP8 and out_features % _ALIGN):
        raise ValueError(
            f"quantization={kind.value} needs matmuls whose input features (and, for fp8, "
            f"output features) are multiples of {_ALIGN} on every tensor-parallel rank; this "
            f"one is [{out_features}, {in_features}]"
        )
    w = weight.detach().float()
    limit = _INT8_MAX if kind is Quant.INT8 else _FP8_MAX
    scale = absmax.to(w.device).clamp(min=1e-12) / limit
    if kind is Quant.INT8:
        # scales are stored in the activation dtype: round up first (no row leaves int8's
        # range), then quantize against the stored scale (error <= half its step)
        act = _activation_dtype(weight.dtype)
        stored = (scale * (1 + 2**-7)).to(act)  # 2^-7: twice bf16's relative rounding error
        q = w / stored.float().unsqueeze(1)
        data = q.round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    else:
        stored = scale
        data = (w / scale.unsqueeze(1)).clamp_(-_FP8_MAX, _FP8_MAX).to(FP8)
    return QuantizedWeight(kind, data.contiguous(), stored.contiguous(), weight.dtype)
