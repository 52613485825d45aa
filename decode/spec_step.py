"""One speculative decoding step over a ragged batch: draft, verify in one forward, accept.

Sequence i brings its pending tokens (its last sampled token, or a whole prompt computed
locally) plus ``k_i`` draft tokens; the target scores all of them in one forward; the rejection
rule (``decode.rejection``) decides how many drafts survive; KV of rejected positions is rolled
back by lowering the counters (the next step overwrites those slots).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.rejection import rejection_sample
from models.llama import LlamaModel
from models.request import Request
from models.runner import SeqInput, run_step
from models.sampling import Stream, accept_uniforms, probs_from_logits, sample_token


@dataclass(frozen=True)
class Emission:
    """What one step produced for one request."""

    tokens: tuple[int, ...]  # accepted drafts, then the recovered or bonus token
    num_drafted: int
    num_accepted: int
    num_fed: int  # tokens the target computed for this request in this step


def decode_step(
    target: LlamaModel,
    kv_pool: torch.Tensor,
    block_size: int,
    drafter: Drafter | None,
    reqs: Sequence[Request],
    ks: Sequence[int],
) -> list[Emission]:
    """Advance every request by one step; ``ks[i] > 0`` only for requests ready to speculate.

    kv_pool: the target group [num_blocks, Hkv, num_layers, 2, block_size, head_dim].
    """
    pending = [r.all_token_ids[r.num_computed :] for r in reqs]
    proposals: list[DraftProposal] = [DraftProposal((), None)] * len(reqs)
    spec = [i for i, k in enumerate(ks) if k > 0]
    if drafter is not None and spec:
        for i, prop in zip(
            spec, drafter.propose([reqs[i] for i in spec], [ks[i] for i in spec]), strict=True
        ):
            proposals[i] = prop

    batch = [
        SeqInput(
            r.block_table,
            r.num_computed,
            pend + list(prop.tokens),
            list(range(len(pend) - 1, len(pend) + len(prop.tokens))),
        )
        for r, pend, prop in zip(reqs, pending, proposals, strict=True)
    ]
    out = run_step(target, kv_pool, block_size, batch)
    row_params = [r.sampling for r, n in zip(reqs, out.rows_per_seq, strict=True) for _ in range(n)]
    p = probs_from_logits(out.logits, row_params)  # [sum(k_i + 1), V]

    num_drafts = [len(prop.tokens) for prop in proposals]
    flat = [t for prop in proposals for t in prop.tokens]
    draft_tokens = torch.tensor(flat, dtype=torch.long, device=p.device)  # [sum k_i]
    with_probs = [prop.probs for prop in proposals if prop.probs is not None]
    draft_probs = torch.cat(with_probs).to(p.device) if with_probs else None  # [sum k_i, V]
    uniforms = torch.cat(
        [
            accept_uniforms(r.sampling, len(r.output_token_ids), k)
            for r, k in zip(reqs, num_drafts, strict=True)
        ]
    )
    ver = rejection_sample(p, draft_tokens, num_drafts, draft_probs, uniforms)

    emissions = []
    for i, (r, prop) in enumerate(zip(reqs, proposals, strict=True)):
        n = int(ver.num_accepted[i])
        final = sample_token(
            ver.final_dist[i], r.sampling, len(r.output_token_ids) + n, Stream.SAMPLE
        )
        r.num_computed += len(pending[i]) + n
        r.num_draft_computed = min(r.num_draft_computed, r.num_computed)
        emissions.append(
            Emission((*prop.tokens[:n], final), len(prop.tokens), n, len(batch[i].token_ids))
        )
    return emissions
