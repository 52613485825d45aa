"""The co-hosted drafter's prefill: its KV over the same prompt chunks as the target, and its
guesses keyed by the target position they rival. EAGLE head position ``t`` reads
``(f_t, x_{t+1})``, so the last prompt position's feature travels in the handoff instead."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.runner import EagleRunner, ModelRunner, SeqInput, StepResult


@dataclass(frozen=True)
class DraftPass:
    rows: list[dict[int, torch.Tensor]]  # per sequence: target position -> draft logits [V]
    computed: list[int]


def run_draft(
    draft: ModelRunner | EagleRunner,
    batch: Sequence[SeqInput],
    target: StepResult,
    prompts: Sequence[Sequence[int]],
) -> DraftPass:
    if not isinstance(draft, EagleRunner):
        out = draft.run(batch)
        rows: list[dict[int, torch.Tensor]] = []
        r = 0
        for s in batch:
            rows.append(
                {s.num_cached + p: out.logits[r + j] for j, p in enumerate(s.logit_positions)}
            )
            r += len(s.logit_positions)
        return DraftPass(rows, [s.num_cached + len(s.token_ids) for s in batch])

    rows = [{} for _ in batch]
    computed = [s.num_cached for s in batch]
    head_batch, feats, owners = [], [], []
    offset = 0
    for i, s in enumerate(batch):
        start, n, length = s.num_cached, len(s.token_ids), len(prompts[i])
        end = min(start + n, length - 1)
        wanted = {s.num_cached + p - 1 for p in s.logit_positions}  # head t rivals target t + 1
        if end > start:
            ids = list(prompts[i][start + 1 : end + 1])
            probe = [t - start for t in range(start, end) if t in wanted]
            head_batch.append(SeqInput(s.block_table, start, ids, probe))
            feats.append(target.all_hidden[offset : offset + (end - start)])
            owners.append(i)
            computed[i] = end
        offset += n
    if head_batch:
        out = draft.run(head_batch, torch.cat(feats))
        r = 0
        for i, s in zip(owners, head_batch, strict=True):
            for p in s.logit_positions:
                rows[i][s.num_cached + p + 1] = out.logits[r]
                r += 1
    return DraftPass(rows, computed)
