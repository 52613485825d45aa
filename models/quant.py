"""Weight quantization of the matmul layers: int8 weight-only and fp8, per output channel.

- ``int8``: symmetric int8 weights with one scale per output channel (``absmax / 127``), the
  activations unquantized. On a CPU the weights are packed for tandem's panel kernel
  (``models.cpu_linear``), which widens them to fp32 in registers and takes fp32 activations,
  or, in a bf16 model on a CPU with the int8 dot-product instruction, multiplies them in
  integers by each bf16 row written as 16-bit integers (``PanelKind.INT8_DIGITS``).
  Elsewhere (a GPU, or a CPU without the kernel) the matmul is PyTorch's
  ``_weight_int8pack_mm``, the kernel gpt-fast and torchao serve int8 weight-only models with;
  its fast paths take bf16 (or fp16) activations, so a float32 model's activations are rounded
  to bf16 for that matmul and its output brought back to float32; the accumulation is float32
  either way.
- ``fp8``: float8 e4m3 weights with one scale per output channel (``absmax / 448``) and the
  activations quantized per token to e4m3 as they arrive (dynamic scaling), multiplied by
  ``torch._scaled_mm`` with row-wise scales: the tensor cores of GPUs of compute capability
  8.9 and later. PyTorch runs the same op on a CPU, slowly, which is what lets a CPU test
  check the arithmetic; serving refuses fp8 anywhere else (``check_supported``).

Scales are taken over whole rows of the checkpoint's matrix, also where a tensor-parallel rank
keeps only some of the columns (a max over the TP group), so every TP layout serves the same
quantized weights and a TP = 1 prefill and a TP = 2 decode agree on the KV they exchange.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # the largest finite e4m3fn value
_INT8_MAX = 127.0
# The int8 kernel's CPU path reads whole 16-column tiles (other widths give wrong results or
# crash), and the fp8 tensor-core matmul needs both dimensions in multiples of 16.
_ALIGN = 16


class Quant(enum.Enum):
    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"


def check_supported(kind: Quant, device: torch.device | str) -> None:
    """Refuse, naming the device, a quantization this device cannot serve fast: fp8 needs a
    CUDA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell)."""
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
    """The activation dtype of the int8 kernel's fast path for a model computing in ``dtype``."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


@dataclass(frozen=True)
class QuantizedWeight:
    """A matmul weight [out, in] as stored for ``kind``, with its per-output-channel scales."""

    kind: Quant
    data: torch.Tensor  # [out, in] int8 or float8_e4m3fn
    scale: torch.Tensor  # [out]: the int8 kernel's activation dtype (int8), float32 (fp8)
    out_dtype: torch.dtype  # what the layer returns: the model's dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] in ``out_dtype``, ``x @ (data * scale)^T (+ bias)``."""
        y = self._product(x)
        return y if bias is None else y + bias

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is Quant.INT8:
            a = x.to(self.scale.dtype)
            y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(a, self.data, self.scale)
            return y.to(self.out_dtype)
        xf = x.float()
        x_scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) / _FP8_MAX  # [T, 1]
        xq = (xf / x_scale).to(FP8)
        y = torch._scaled_mm(
            xq,
            self.data.t(),
            scale_a=x_scale,
            scale_b=self.scale.view(1, -1),
            out_dtype=torch.bfloat16 if x.device.type == "cuda" else torch.float32,
        )  # [T, out]; CUDA's row-wise scaled matmul writes bf16 only
        return y.to(self.out_dtype)

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32: the weight the matmul multiplies by (for tests and checks)."""
        return self.data.float() * self.scale.float().unsqueeze(1)


def row_absmax(weight: torch.Tensor, group: Any = None) -> torch.Tensor:
    """[out] float32: each row's largest |value| of ``weight`` [out, in_local]; with a TP
    ``group`` (a c10d ProcessGroup) over every rank's columns of that row."""
    m = weight.detach().abs().amax(dim=1).float()  # [out]
    if group is not None:
        group.allreduce([m], torch.distributed.ReduceOp.MAX).wait()
    return m


def quantize(weight: torch.Tensor, kind: Quant, absmax: torch.Tensor) -> QuantizedWeight:
    """``weight`` [out, in] quantized per output channel with the rows' ``absmax`` [out]."""
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
    scale = absmax.to(w.device).clamp(min=1e-12) / limit  # [out]
    if kind is Quant.INT8:
        # The kernel takes its scales in the activation dtype: round them first (up, so that
        # no row's largest value leaves the int8 range) and quantize against the stored scale,
        # so each value is off by at most half a step of the scale the matmul multiplies by.
        act = _activation_dtype(weight.dtype)
        stored = (scale * (1 + 2**-7)).to(act)  # 2^-7: twice bf16's relative rounding error
        q = w / stored.float().unsqueeze(1)
        data = q.round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    else:
        stored = scale
        data = (w / scale.unsqueeze(1)).clamp_(-_FP8_MAX, _FP8_MAX).to(FP8)
    return QuantizedWeight(kind, data.contiguous(), stored.contiguous(), weight.dtype)
