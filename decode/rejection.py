"""Speculative verification: the rejection rule that keeps the output the target's.

A step verifies ``w`` consecutive output positions of one sequence with one target forward,
which yields the target distributions ``p_1 .. p_w``. The drafter proposes tokens ``d_j`` drawn
from its distributions ``q_j`` (all under the same sampling transform) for the first ``t``
positions, ``t = w`` or ``t = w - 1`` (a drafter may have nothing to propose at the last one):

- **accepted**: ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))``, tested left
  to right with uniform ``u_j``: accept iff ``u_j * q_j(d_j) < p_j(d_j)``; the first rejection
  ends the run. A one-hot draft (n-gram) has ``q_j(d_j) = 1``.
- **recovered**: after the first rejection, at position ``n + 1``, one token is drawn from
  ``norm(max(0, p_{n+1} - q_{n+1}))``.
- **bonus**: if all ``t = w - 1`` drafts pass, one token is drawn from ``p_w``. If all ``t = w``
  pass, the last accepted draft is already the token at position ``w``: there is no bonus.

Each position's token is thus produced by the same rule whichever step it falls in — tested
against the drafter's proposal when there is one, drawn from ``p`` when there is none — and
with randomness keyed by position (``models.sampling``) a seeded request gives the same tokens
whatever ``w`` the scheduler picked and whatever shares its batch. The emitted sequence is
distributed exactly as sampling from the target alone. Greedy requests have one-hot ``p`` and
``q``, so a draft is accepted iff it is the target's argmax: the output is the target's greedy
output.

These functions are pure: the caller supplies the uniforms and samples the final distribution
with each request's own generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
    """Verify a ragged batch of drafts.

    target_probs: [sum(w_i), V], sequence i's w_i rows contiguous, in batch order.
    rows: w_i >= 1 per sequence.
    draft_tokens: [sum(t_i)] flat draft tokens in the same order, t_i in {w_i - 1, w_i}.
    num_drafts: t_i per sequence.
    draft_probs: [sum(t_i), V] draft distributions, or None for one-hot drafts.
    uniforms: [sum(t_i)] values in [0, 1) for the accept tests.
    """
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
        n = lay.leading(uniforms.to(dev) * q_tok < p_tok)

    has_final = n < ws
    p_final = target_probs[row_start + n.clamp(max=ws - 1)]  # [B, V]
    rejected = n < ts  # [B]
    if tmax > 0:  # where some draft was tested, some may be rejected
        idx = (draft_start + n).clamp(max=max(int(draft_tokens.numel()) - 1, 0))
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
    """``rejection_sample`` for greedy sequences, whose distributions are one-hot: a draft is
    accepted iff it is the target's argmax there, and the final token is the argmax after the
    accepted ones; no distribution over the vocabulary is built.

    target_tokens: [sum(w_i)] the argmax of each row; the other arguments as in
    ``rejection_sample``.
    """
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
    """Where each sequence's target rows and draft tokens lie in a ragged verification batch."""

    ws: torch.Tensor  # [B] target rows per sequence
    ts: torch.Tensor  # [B] drafts per sequence
    row_start: torch.Tensor  # [B] first target row of each sequence
    draft_start: torch.Tensor  # [B] first draft of each sequence
    tmax: int  # the most drafts of any sequence
    seq_of: torch.Tensor  # [N] the sequence of each draft
    pos_in: torch.Tensor  # [N] each draft's position in its sequence

    @classmethod
    def of(cls, rows: Sequence[int], num_drafts: Sequence[int], dev: torch.device) -> _Ragged:
        _check_drafts(rows, num_drafts)
        ws = torch.tensor(list(rows), dtype=torch.long, device=dev)
        ts = torch.tensor(list(num_drafts), dtype=torch.long, device=dev)
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
    """Checked on the host, so verification never waits for the device to answer."""
    if len(rows) != len(num_drafts) or any(
        t not in (w, w - 1) for w, t in zip(rows, num_drafts, strict=True)
    ):
        raise ValueError("each sequence must bring w or w - 1 drafts for its w rows")
