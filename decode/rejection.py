"""Rejection sampling over ``w`` positions and ``t`` in {w - 1, w} drafts: accept d_j with
min(1, p_j(d_j) / q_j(d_j)) until the first rejection, recover from norm(max(0, p - q)) there,
else a bonus from p_w (none when t = w). Pure: the caller supplies uniforms and samples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.device_copy import to_device


@dataclass(frozen=True)
class Verification:
    num_accepted: torch.Tensor  # [B] leading draft tokens accepted per sequence
    has_final: torch.Tensor  # [B] bool: a recovered or bonus token follows the accepted ones
    final_dist: torch.Tensor  # [B, V] its distribution (rows where has_final is False: unused)


def rejection_sample(
    target_probs: torch.Tensor,
    rows: Sequence[int],
    draft_tokens: torch.Tensor,
    num_drafts: Sequence[int],
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> Verification:
    """target_probs [sum w_i, V], draft_tokens and uniforms [sum t_i], draft_probs [sum t_i, V]
    or None (one-hot); ``rows`` and ``num_drafts`` give each sequence's w_i and t_i."""
    dev = target_probs.device
    lay = _Ragged.of(rows, num_drafts, dev)
    ws, ts, row_start, draft_start, tmax = lay.ws, lay.ts, lay.row_start, lay.draft_start, lay.tmax
    n = torch.zeros(len(rows), dtype=torch.long, device=dev)
    if tmax > 0:
        p_tok = target_probs[lay.draft_rows].gather(1, draft_tokens.unsqueeze(1)).squeeze(1)
        q_tok = (
            draft_probs.gather(1, draft_tokens.unsqueeze(1)).squeeze(1)
            if draft_probs is not None
            else torch.ones_like(p_tok)
        )  # [N]
        n = lay.leading(uniforms.to(dev, non_blocking=True) * q_tok < p_tok)

    has_final = n < ws
    p_final = target_probs[row_start + n.clamp(max=ws - 1)]  # [B, V]
    rejected = n < ts  # [B]
    if tmax > 0:
        idx = (draft_start + n).clamp(max=max(int(draft_tokens.numel()) - 1, 0))
        if draft_probs is not None:
            q_rej = draft_probs[idx]  # [B, V]
        else:
            q_rej = torch.zeros_like(p_final)
            q_rej.scatter_(1, draft_tokens[idx].unsqueeze(1), 1.0)
        residual = (p_final - q_rej).clamp(min=0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # a zero residual (p == q, so only from rounding): p itself is right
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_final)
        p_final = torch.where(rejected.unsqueeze(1), residual, p_final)
    return Verification(num_accepted=n, has_final=has_final, final_dist=p_final)


@dataclass(frozen=True)
class GreedyVerification:
    num_accepted: torch.Tensor  # [B] leading drafts equal to the target's argmax
    has_final: torch.Tensor  # [B] bool: the target's token follows the accepted ones
    final_token: torch.Tensor  # [B] that token (rows where has_final is False: unused)


def verify_greedy(
    target_tokens: torch.Tensor,
    rows: Sequence[int],
    draft_tokens: torch.Tensor,
    num_drafts: Sequence[int],
) -> GreedyVerification:
    """``rejection_sample`` for greedy sequences; target_tokens [sum w_i]: each row's argmax."""
    dev = target_tokens.device
    lay = _Ragged.of(rows, num_drafts, dev)
    n = torch.zeros(len(rows), dtype=torch.long, device=dev)
    if lay.tmax > 0:
        n = lay.leading(target_tokens[lay.draft_rows] == draft_tokens)
    ws = lay.ws
    final = target_tokens[lay.row_start + n.clamp(max=ws - 1)]  # [B]
    return GreedyVerification(num_accepted=n, has_final=n < ws, final_token=final)


@dataclass(frozen=True)
class _Ragged:
    ws: torch.Tensor  # [B] target rows per sequence
    ts: torch.Tensor  # [B] drafts per sequence
    row_start: torch.Tensor  # [B] first target row of each sequence
    draft_start: torch.Tensor  # [B] first draft of each sequence
    tmax: int
    seq_of: torch.Tensor  # [N] the sequence of each draft
    pos_in: torch.Tensor  # [N] each draft's position in its sequence

    @classmethod
    def of(cls, rows: Sequence[int], num_drafts: Sequence[int], dev: torch.device) -> _Ragged:
        _check_drafts(rows, num_drafts)
        ws = to_device(list(rows), dev, torch.long)
        ts = to_device(list(num_drafts), dev, torch.long)
        draft_start = torch.cumsum(ts, 0) - ts
        seq_of = torch.repeat_interleave(
            torch.arange(len(rows), device=dev), ts, output_size=sum(num_drafts)
        )
        pos_in = torch.arange(seq_of.numel(), device=dev) - draft_start[seq_of]
        tmax = int(max(num_drafts, default=0))
        return cls(ws, ts, torch.cumsum(ws, 0) - ws, draft_start, tmax, seq_of, pos_in)

    @property
    def draft_rows(self) -> torch.Tensor:
        """[N] the target row each draft token is tested against."""
        return self.row_start[self.seq_of] + self.pos_in

    def leading(self, ok: torch.Tensor) -> torch.Tensor:
        """ok: [N] bool per draft -> [B] how many leading drafts of each sequence are ok."""
        grid = torch.zeros(len(self.ws), self.tmax, dtype=torch.long, device=ok.device)
        grid[self.seq_of, self.pos_in] = ok.long()
        return grid.cumprod(dim=1).sum(dim=1)


def _check_drafts(rows: Sequence[int], num_drafts: Sequence[int]) -> None:
    if len(rows) != len(num_drafts) or any(
        t not in (w, w - 1) for w, t in zip(rows, num_drafts, strict=True)
    ):
        raise ValueError("each sequence must bring w or w - 1 drafts for its w rows")
