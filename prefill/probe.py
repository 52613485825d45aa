"""The acceptance probe of one prompt: the mean chance a draft token is accepted over the
prompt's last positions, scored as decode will draft (model, n-gram lookup, or lookup first)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from models.acceptance import one_hot_overlap, overlap, probe_estimate
from models.ngram import NgramIndex
from models.sampling import SamplingParams, probs_from_logits
from models.spec import DraftKind, DraftSpec


def acceptance_probe(
    draft: DraftSpec,
    prompt: Sequence[int],
    sampling: SamplingParams,
    positions: Sequence[int],
    probs: torch.Tensor,
    draft_logits: Mapping[int, torch.Tensor],
) -> float | None:
    """probs: [len(positions), V] the target's distributions; draft_logits: the draft's [V] logits
    by target position (empty without a model drafter). None when nothing could be scored."""
    if draft_logits:
        both = [j for j, u in enumerate(positions) if u in draft_logits]
        if not both:
            return None
        q_logits = torch.stack([draft_logits[positions[j]] for j in both])
        q = probs_from_logits(q_logits, [sampling] * len(both))
        per = overlap(probs[both], q)
        if draft.lookup_first:
            props = lookups(draft, prompt, [positions[j] for j in both], probs.device)
            per = torch.where(props >= 0, one_hot_overlap(probs[both], props), per)
        return probe_estimate(per)
    if draft.kind is DraftKind.NGRAM:
        return probe_estimate(
            one_hot_overlap(probs, lookups(draft, prompt, positions, probs.device))
        )
    return None


def lookups(
    draft: DraftSpec, prompt: Sequence[int], positions: Sequence[int], device: torch.device
) -> torch.Tensor:
    """[len(positions)] the n-gram proposal after each prompt position (-1: none)."""
    index = NgramIndex(draft.ngram_max, draft.ngram_min)
    props = {}
    for t in sorted(set(positions)):
        index.extend(prompt[len(index) : t + 1])
        props[t] = (index.follow(1) or [-1])[0]
    return torch.tensor([props[t] for t in positions], device=device)
