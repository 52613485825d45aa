"""Log-probabilities of emitted tokens, as the API reports them (``logprobs``, ``top_logprobs``).

What is reported is the target model's log-softmax over the whole vocabulary at the position
that produced the token, before temperature, top-k and top-p (vLLM's default, "raw" logprobs):
the model's own belief, comparable across requests whatever their sampling settings. Under
speculation it is read from the verification forward's row for that position, so it is the
target's for every emitted token whatever the drafter proposed (a draft only decides how many
rows one forward covers). Computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability and the most likely alternatives at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprob]:
    """logits: [N, V] the rows that produced ``tokens`` (one each); ``tops[i]`` alternatives
    for row i. One log-softmax and one top-k over the batch, two device->host copies."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=logits.device)  # [N]
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1)  # [N]
    k = max(tops)
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], ids[:, None][:, :0])  # [N, k]
    values = torch.cat([chosen.unsqueeze(1), top_v], dim=1).tolist()  # [N, 1 + k]
    top_ids = top_i.tolist()
    return [
        TokenLogprob(t, v[0], tuple(zip(ti[:n], v[1 : 1 + n], strict=True)))
        for t, v, ti, n in zip(tokens, values, top_ids, tops, strict=True)
    ]
