"""One speculative decoding step over a ragged batch: draft, verify in one forward, accept.

Sequence i brings ``new_tokens[i]`` known tokens not yet in the KV cache (its last sampled
token, or a chunk of a prompt computed locally). Sequences whose tokens reach the end of what
is known sample this step: such a sequence verifies ``w_i = min(m_i, k_i) + 1`` output
positions, where ``m_i`` is how many positions the drafter proposed for (of ``k_i + 1`` asked)
— the target scores its pending tokens plus ``w_i - 1`` drafts in one forward, and the
rejection rule (``decode.rejection``) tests the drafts. KV of rejected positions is rolled back
by lowering the counters (the next step overwrites those slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.rejection import rejection_sample
from models.request import Request
from models.runner import ModelRunner, SeqInput
from models.sampling import Stream, accept_uniforms, probs_from_logits, sample_token


@dataclass(frozen=True)
class Emission:
    """What one step produced for one request."""

    tokens: tuple[int, ...]  # accepted drafts, then the recovered or bonus token; () mid-prompt
    num_drafted: int  # draft tokens tested
    num_accepted: int
    num_fed: int  # tokens the target computed for this request in this step


NO_DRAFT = DraftProposal((), None)


def _propose(
    drafter: Drafter | None, reqs: Sequence[Request], samples: Sequence[bool], ks: Sequence[int]
) -> list[DraftProposal]:
    # Position 0 (the first token of a prompt computed here) is never drafted: prefill samples
    # it plainly too, so both modes produce it by the same rule.
    ask = [i for i, r in enumerate(reqs) if samples[i] and r.output_token_ids]
    out = [NO_DRAFT] * len(reqs)
    if drafter is not None and ask:
        got = drafter.propose([reqs[i] for i in ask], [ks[i] + 1 for i in ask])
        for i, prop in zip(ask, got, strict=True):
            out[i] = prop
    return out


def _draft_probs(
    proposals: Sequence[DraftProposal], tested: Sequence[Sequence[int]], p: torch.Tensor
) -> torch.Tensor | None:
    """[sum t_i, V] the tested drafts' distributions, or None when every draft is one-hot. A
    batch mixing both (lookup-first drafting) gives its one-hot drafts one-hot rows."""
    if all(prop.probs is None for prop in proposals):
        return None
    rows = []
    for prop, t in zip(proposals, tested, strict=True):
        if prop.probs is not None:
            rows.append(prop.probs[: len(t)].to(p.device))
        elif t:
            ids = torch.tensor(list(t), dtype=torch.long, device=p.device)
            rows.append(torch.nn.functional.one_hot(ids, p.shape[1]).to(p.dtype))
    return torch.cat(rows) if rows else None


def decode_step(
    target: ModelRunner,
    drafter: Drafter | None,
    reqs: Sequence[Request],
    new_tokens: Sequence[int],
    ks: Sequence[int],
) -> list[Emission]:
    """Advance every request by one step; ``ks[i]`` extra positions may be verified for it."""
    pending = [
        r.all_token_ids[r.num_computed : r.num_computed + n]
        for r, n in zip(reqs, new_tokens, strict=True)
    ]
    samples = [r.num_computed + n == r.num_tokens for r, n in zip(reqs, new_tokens, strict=True)]
    proposals = _propose(drafter, reqs, samples, ks)
    widths = [min(len(p.tokens), k) + 1 for p, k in zip(proposals, ks, strict=True)]
    batch = [
        SeqInput(
            r.block_table,
            r.num_computed,
            pend + list(prop.tokens[: w - 1]),
            list(range(len(pend) - 1, len(pend) - 1 + w)) if sample else [],
        )
        for r, pend, prop, w, sample in zip(reqs, pending, proposals, widths, samples, strict=True)
    ]
    out = target.run(batch)

    emissions = [Emission((), 0, 0, len(b.token_ids)) for b in batch]
    offsets = [0]
    for b in batch:
        offsets.append(offsets[-1] + len(b.token_ids))
    sampled = [i for i, s in enumerate(samples) if s]
    for i, s in enumerate(samples):
        if not s:
            _observe(drafter, reqs[i], out.all_hidden, offsets[i], new_tokens[i])
            reqs[i].num_computed += new_tokens[i]
    if not sampled:
        return emissions
    row_params = [reqs[i].sampling for i in sampled for _ in range(widths[i])]
    p = probs_from_logits(out.logits, row_params)  # [sum(w_i), V] over sampled sequences
    tested = [proposals[i].tokens[: widths[i]] for i in sampled]
    flat = [t for toks in tested for t in toks]
    draft_tokens = torch.tensor(flat, dtype=torch.long, device=p.device)  # [sum t_i]
    draft_probs = _draft_probs([proposals[i] for i in sampled], tested, p)  # [sum t_i, V] | None
    uniforms = torch.cat(
        [
            accept_uniforms(reqs[i].sampling, len(reqs[i].output_token_ids), len(t))
            for i, t in zip(sampled, tested, strict=True)
        ]
    )
    ver = rejection_sample(
        p,
        [widths[i] for i in sampled],
        draft_tokens,
        [len(t) for t in tested],
        draft_probs,
        uniforms,
    )
    for row, (i, toks) in enumerate(zip(sampled, tested, strict=True)):
        r = reqs[i]
        n = int(ver.num_accepted[row])
        emitted = toks[:n]
        if bool(ver.has_final[row]):
            pos = len(r.output_token_ids) + n
            emitted += (sample_token(ver.final_dist[row], r.sampling, pos, Stream.SAMPLE),)
        # KV now holds the pending tokens and the accepted drafts that were fed.
        valid = len(pending[i]) + min(n, widths[i] - 1)
        _observe(drafter, r, out.all_hidden, offsets[i], valid)
        r.num_computed += valid
        r.num_draft_computed = min(r.num_draft_computed, r.num_computed)
        emissions[i] = Emission(emitted, len(toks), n, len(batch[i].token_ids))
    return emissions


def _observe(drafter: Drafter | None, r: Request, hidden: torch.Tensor, start: int, n: int) -> None:
    """Hand a drafter that reads target features those of the positions that stayed valid."""
    if drafter is not None and drafter.needs_features:
        drafter.observe(r, hidden[start : start + n])
