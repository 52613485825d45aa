"""Small building blocks of the Llama decoder: RMSNorm, rotary position embedding, and the
row ops they and the MLP run through."""

from __future__ import annotations

import torch
from torch import nn

from models.config import RopeScaling


class RowOps:
    """The per-row arithmetic of a layer in PyTorch ops. A model is built with one instance,
    handed to every norm, rotary embedding and MLP; a device wing may subclass it with
    kernels that give the same values (``models.cpu.row_ops``)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [..., H] -> ``x / rms(x) * weight``, in float32 as the reference computes it."""
        if x.dtype == torch.float32:
            return nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., T, heads, head_dim] at the positions of ``cos``, ``sin``
        [T, 1, 2, head_dim / 2] (``rotary_tables``), in float32: ``(x1, x2) -> (x1 cos - x2
        sin, x2 cos + x1 sin)`` as one multiply-add over both halves and their swap, four ops
        where the textbook form takes nine, bit-identical to it."""
        halves = x.float().unflatten(-1, (2, -1))  # [..., T, heads, 2, head_dim / 2]
        out: torch.Tensor = halves * cos + halves.flip(-2) * sin
        return out.flatten(-2).to(x.dtype)

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        """gate_up: [T, 2 * inter], the gate then the up projection -> silu(gate) * up."""
        gate, up = gate_up.split(inter, dim=-1)
        act: torch.Tensor = nn.functional.silu(gate) * up
        return act


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` through the model's row ops."""

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
        # x: [T, hidden]
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
        inv_freq = (scaling or RopeScaling()).inv_freq(head_dim, theta).to(device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., T, heads, head_dim] (a strided view is fine) rotated (``RowOps.rope``)."""
        return self.ops.rope(cos, sin, x)


def rotary_tables(
    rope_cos: torch.Tensor, rope_sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The angles ``RotaryEmbedding.forward`` takes for tokens at ``positions`` [T], from its
    ``cos``, ``sin`` tables [max_positions, head_dim / 2]: ``(cos, cos)`` and ``(-sin, sin)``,
    each [T, 1, 2, head_dim / 2]. Built once per step (device ops only, so a CUDA graph can
    hold them) and shared by every layer."""
    cos = rope_cos[positions]  # [T, head_dim / 2]
    sin = rope_sin[positions]
    both_cos = torch.stack((cos, cos), 1).unsqueeze(1)  # [T, 1, 2, head_dim / 2]
    signed_sin = torch.stack((-sin, sin), 1).unsqueeze(1)
    return both_cos, signed_sin
