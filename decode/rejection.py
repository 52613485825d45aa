"""Speculative verification: the rejection rule that keeps the output the target's.

For one sequence with draft tokens ``d_1 .. d_k`` drawn from draft distributions ``q_1 .. q_k``
and target distributions ``p_1 .. p_{k+1}`` (``p_j`` predicts the token at draft position j,
``p_{k+1}`` the one after the last draft), all under the same sampling transform:

- **accepted** tokens: ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``,
  tested left to right with uniform ``u_j``: accept iff ``u_j * q_j(d_j) < p_j(d_j)``; the first
  rejection ends the run. A one-hot draft (n-gram) has ``q_j(d_j) = 1``.
- **recovered** token: after the first rejection at position ``n + 1``, one token is drawn from
  ``norm(max(0, p_{n+1} - q_{n+1}))``.
- **bonus** token: if all k drafts pass, one token is drawn from ``p_{k+1}``.

Each step therefore emits ``n + 1`` tokens (``n`` accepted plus one recovered or bonus), and
the emitted sequence is distributed exactly as sampling from the target alone. With ``k = 0``
the rule reduces to sampling from ``p_1``. Greedy requests have one-hot ``p`` and ``q``, so a
draft is accepted iff it is the target's argmax, and the output is the target's greedy output.

These functions are pure: the caller supplies the uniforms and samples the final distribution
with each request's own generator, so results do not depend on what shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verification:
    num_accepted: torch.Tensor  # [B] leading draft tokens accepted per sequence
    final_dist: torch.Tensor  # [B, V] distribution of the recovered (n < k) or bonus (n = k) token


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> Verification:
    """Verify a ragged batch of drafts.

    target_probs: [sum(k_i + 1), V], sequence i's k_i + 1 rows contiguous, in batch order.
    draft_tokens: [sum(k_i)] flat draft tokens in the same order.
    num_drafts: k_i per sequence (0 allowed).
    draft_probs: [sum(k_i), V] draft distributions, or None for one-hot drafts.
    uniforms: [sum(k_i)] values in [0, 1) for the accept tests.
    """
    b = len(num_drafts)
    dev = target_probs.device
    ks = torch.tensor(list(num_drafts), dtype=torch.long, device=dev)  # [B]
    row_start = torch.cumsum(ks + 1, 0) - (ks + 1)  # [B] first target row of each sequence
    kmax = int(ks.max()) if b else 0
    n = torch.zeros(b, dtype=torch.long, device=dev)
    seq_of = torch.repeat_interleave(torch.arange(b, device=dev), ks)  # [N]
    pos_in = torch.arange(seq_of.numel(), device=dev) - (torch.cumsum(ks, 0) - ks)[seq_of]  # [N]
    if kmax > 0:
        rows = row_start[seq_of] + pos_in  # [N] target row predicting each draft token
        p_tok = target_probs[rows].gather(1, draft_tokens.unsqueeze(1)).squeeze(1)  # [N]
        q_tok = (
            draft_probs.gather(1, draft_tokens.unsqueeze(1)).squeeze(1)
            if draft_probs is not None
            else torch.ones_like(p_tok)
        )
        accept = uniforms.to(dev) * q_tok < p_tok  # [N]
        grid = torch.zeros(b, kmax, dtype=torch.long, device=dev)
        grid[seq_of, pos_in] = accept.long()
        n = grid.cumprod(dim=1).sum(dim=1)  # [B]

    p_final = target_probs[row_start + n]  # [B, V]
    rejected = n < ks  # [B]
    if bool(rejected.any()):
        first_draft = torch.cumsum(ks, 0) - ks  # [B] index of each sequence's first draft
        idx = (first_draft + n).clamp(max=max(int(draft_tokens.numel()) - 1, 0))
        if draft_probs is not None:
            q_rej = draft_probs[idx]  # [B, V]
        else:
            q_rej = torch.zeros_like(p_final)
            q_rej.scatter_(1, draft_tokens[idx].unsqueeze(1), 1.0)
        residual = (p_final - q_rej).clamp(min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # A zero residual means p == q at that position, which rejects with probability 0;
        # it can only arise from rounding, and p itself is then the right distribution.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_final)
        p_final = torch.where(rejected.unsqueeze(1), residual, p_final)
    return Verification(num_accepted=n, final_dist=p_final)
