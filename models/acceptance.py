"""The acceptance probe: a draft token is accepted with probability ``sum_x min(p(x), q(x))``,
which prefill measures over the prompt's last positions before decode starts."""

from __future__ import annotations

import torch


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q: [W, V] distributions -> [W] per-position acceptance probability."""
    return torch.minimum(p, q).sum(dim=-1)


def one_hot_overlap(p: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """p: [W, V]; proposals: [W] token ids (-1: none, contributing zero) -> [W] p(proposal)."""
    idx = proposals.clamp(min=0).unsqueeze(1)
    return torch.where(proposals >= 0, p.gather(1, idx).squeeze(1), torch.zeros_like(p[:, 0]))


def probe_estimate(per_position: torch.Tensor) -> float | None:
    if per_position.numel() == 0:
        return None
    return float(per_position.mean().item())
