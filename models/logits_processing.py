"""The logits processors that depend on the tokens before a position: penalties, logit bias,
min_tokens and grammar masks. Speculation stays exact because target and draft rows go through
this one function, each row with what precedes its own position (emitted tokens, then the
drafts before it), so every position sees the same transform whichever model scores it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.device_copy import to_device
from models.sampling import SamplingParams


@dataclass(frozen=True)
class ProcessRow:
    params: SamplingParams
    prompt: Sequence[int]
    before: Sequence[int]  # output tokens before this position: emitted, then drafts
    allowed: torch.Tensor | None = None  # [words] int32 grammar bitmask; None: no grammar


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask: [N, W] int32 -> [N, vocab] bool (ids past the mask's 32 W are refused)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [N, 32 W]
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(bits.shape[0], vocab - bits.shape[1], dtype=torch.bool, device=bits.device)
    return torch.cat([bits, pad], dim=1)


def process_logits(logits: torch.Tensor, rows: Sequence[ProcessRow]) -> torch.Tensor:
    """logits: [N, V] -> [N, V] float32, vLLM's order: penalties (repetition over prompt and
    output, frequency and presence over output), logit bias, then the bans (grammar; ids not in
    allowed_token_ids; stop ids under min_tokens, unless nothing would then be allowed)."""
    x = logits.float().clone()
    n, v = x.shape
    dev = x.device
    if any(_penalized(r.params) for r in rows):
        x = _penalties(x, rows)
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias]
    if biased:
        i, t, b = zip(*biased, strict=True)
        idx = (to_device(i, dev), to_device(t, dev))
        x.index_put_(idx, to_device(b, dev, x.dtype), accumulate=True)
    allowed = torch.ones(n, v, dtype=torch.bool, device=dev)
    grammar = [(i, r.allowed) for i, r in enumerate(rows) if r.allowed is not None]
    if grammar:
        masks = torch.stack([m for _, m in grammar]).to(dev)  # [G, W]
        allowed[to_device([i for i, _ in grammar], dev)] = allowed_tokens(masks, v)
    only = [(i, t) for i, r in enumerate(rows) for t in r.params.allowed_token_ids if t < v]
    if only:
        i, t = zip(*only, strict=True)
        keep = torch.zeros(n, v, dtype=torch.bool, device=dev)
        keep[to_device(i, dev), to_device(t, dev)] = True
        listed = to_device([bool(r.params.allowed_token_ids) for r in rows], dev)
        allowed &= keep | ~listed.unsqueeze(1)
    early = [
        (i, t)
        for i, r in enumerate(rows)
        if len(r.before) < r.params.min_tokens
        for t in r.params.stop_token_ids
        if t < v
    ]
    if early:
        i, t = zip(*early, strict=True)
        ban = torch.zeros(n, v, dtype=torch.bool, device=dev)
        ban[to_device(i, dev), to_device(t, dev)] = True
        left = (allowed & ~ban).any(dim=1, keepdim=True)  # [N, 1]
        allowed = torch.where(left, allowed & ~ban, allowed)
    return x.masked_fill(~allowed, float("-inf"))


def _penalized(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _penalties(x: torch.Tensor, rows: Sequence[ProcessRow]) -> torch.Tensor:
    n, v = x.shape
    dev = x.device
    counts = _counts([r.before for r in rows], n, v, dev)  # [N, V] output occurrences
    rep = to_device([r.params.repetition_penalty for r in rows], dev).unsqueeze(1)
    if any(r.params.repetition_penalty != 1.0 for r in rows):  # on the host: no device read
        prompts = [r.prompt if r.params.repetition_penalty != 1.0 else () for r in rows]
        seen = (_counts(prompts, n, v, dev) > 0) | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = to_device([r.params.frequency_penalty for r in rows], dev).unsqueeze(1)
    pres = to_device([r.params.presence_penalty for r in rows], dev).unsqueeze(1)
    return x - freq * counts - pres * (counts > 0).float()


def _counts(seqs: Sequence[Sequence[int]], n: int, v: int, dev: torch.device) -> torch.Tensor:
    """[n, v] float32: how often each id occurs in each sequence."""
    counts = torch.zeros(n, v, device=dev)
    if not any(seqs):
        return counts
    ids = to_device([t for s in seqs for t in s], dev, torch.long)
    row = to_device([i for i, s in enumerate(seqs) for _ in s], dev, torch.long)
    counts.index_put_((row, ids), torch.ones_like(ids, dtype=counts.dtype), accumulate=True)
    return counts
