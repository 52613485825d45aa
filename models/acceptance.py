"""The acceptance probe: how well a draft predicts the target, measured on the prompt.

Under the speculative rule (accept x with probability ``min(1, p(x)/q(x))``) the chance that a
draft token is accepted at a position is ``sum_x min(p(x), q(x))``. Prefill has both models'
distributions over the prompt for free; the mean of that overlap over the last positions is the
request's acceptance estimate before decode starts.
"""

from __future__ import annotations

import torch


def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """p, q: [W, V] distributions -> [W] per-position acceptance probability."""
    return torch.minimum(p, q).sum(dim=-1)


def one_hot_overlap(p: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """p: [W, V]; proposals: [W] token ids (-1 where the drafter proposes nothing) -> [W].

    A one-hot draft (n-gram lookup) is accepted with probability ``p(proposal)``; a position
    without a proposal contributes zero.
    """
    idx = proposals.clamp(min=0).unsqueeze(1)
    return torch.where(proposals >= 0, p.gather(1, idx).squeeze(1), torch.zeros_like(p[:, 0]))


def probe_estimate(per_position: torch.Tensor) -> float | None:
    """Mean of per-position acceptance probabilities, or None when there were no positions."""
    if per_position.numel() == 0:
        return None
    return float(per_position.mean().item())
