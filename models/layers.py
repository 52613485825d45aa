"""Small building blocks of the Llama decoder: RMSNorm and rotary position embedding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from models.config import RopeScaling

if TYPE_CHECKING:
    from models.cpu_rowops import CpuRowOps


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 as the reference implementation does; on a
    CPU model in one call of ``models.cpu_rowops`` (``native``, set when the model is packed
    for the CPU)."""

    native: CpuRowOps | None = None

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        if self.native is not None and x.dim() == 2 and self.native.takes(x):
            return self.native.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" convention used by HF Llama checkpoints;
    on a CPU model in one call of ``models.cpu_rowops`` (``native``), bit-identical."""

    native: CpuRowOps | None = None

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        device: torch.device,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        inv_freq = (scaling or RopeScaling()).inv_freq(head_dim, theta).to(device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [..., T, heads, head_dim] (a strided view is fine) at the positions of
        ``cos``, ``sin`` [T, 1, 2, head_dim / 2] (``rotary_tables``), in float32.

        ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` as one multiply-add over both
        halves and their swap: four ops where the textbook form takes nine, and the query and
        key heads of a layer can go through it in one call. Bit-identical to the textbook form
        (``a - b`` is ``a + (-b)`` in IEEE arithmetic)."""
        native = self.native
        if native is not None and x.dim() == 3 and x.stride(1) == x.shape[2] and native.takes(x):
            return native.rope(cos, sin, x)  # [T, heads, head_dim]
        halves = x.float().unflatten(-1, (2, -1))  # [..., T, heads, 2, head_dim / 2]
        out: torch.Tensor = halves * cos + halves.flip(-2) * sin
        return out.flatten(-2).to(x.dtype)


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
