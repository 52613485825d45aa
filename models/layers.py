"""RMSNorm, rotary embedding, and the row ops they and the MLP run through."""

from __future__ import annotations

import torch
from torch import nn

from models.rope_scaling import RopeScaling


class RowOps:
    """A layer's per-row arithmetic in PyTorch ops; a device may subclass it with kernels that
    give the same values (``models.cpu.row_ops``)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, D] rotated by ``rotary_tables``' [T, 1, 2, D / 2], in float32: one
        multiply-add over both halves and their swap, bit-identical to the textbook form."""
        halves = x.float().unflatten(-1, (2, -1))  # [..., T, heads, 2, D / 2]
        out: torch.Tensor = halves * cos + halves.flip(-2) * sin
        return out.flatten(-2).to(x.dtype)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = gate_up.split(inter, dim=-1)
        act: torch.Tensor = nn.functional.silu(gate) * up
        return act


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops or RowOps()
        self.weight = nn.Parameter(
            torch.ones(hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" convention of HF Llama checkpoints."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        device: torch.device,
        scaling: RopeScaling | None = None,
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops or RowOps()
        scaling = scaling or RopeScaling()
        inv_freq = scaling.inv_freq(head_dim, theta).to(device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        af = scaling.attention_factor  # YaRN's: cos and sin scaled alike
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos() * af, persistent=False)
        self.register_buffer("sin", freqs.sin() * af, persistent=False)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rope(cos, sin, x)


def rotary_tables(
    rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, cos)`` and ``(-sin, sin)`` [T, 1, 2, D / 2] at ``positions`` [T], built once per
    step with device ops only (CUDA graphs hold them)."""
    cos = rope_cos[positions]
    sin = rope_sin[positions]
    both_cos = torch.stack((cos, cos), 1).unsqueeze(1)
    signed_sin = torch.stack((-sin, sin), 1).unsqueeze(1)
    return both_cos, signed_sin
