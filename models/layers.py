"""Small building blocks of the Llama decoder: RMSNorm and rotary position embedding."""

from __future__ import annotations

import torch
from torch import nn

from models.config import RopeScaling


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 as the reference implementation does."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(hidden, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]
        if x.dtype == torch.float32:
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" convention used by HF Llama checkpoints."""

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
        # cos, sin: [T, 1, head_dim / 2], gathered once per step; x: [T, heads, head_dim]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)
