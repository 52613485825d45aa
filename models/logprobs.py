"""Log-probabilities of emitted tokens as the API reports them: the target's raw log-softmax
(before temperature, top-k, top-p) in float32, from the row that produced each token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.device_copy import to_device

MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], tops: Sequence[int]
) -> list[TokenLogprob]:
    """logits: [N, V] the rows that produced ``tokens``; ``tops[i]`` alternatives for row i."""
    if not tokens:
        return []
    ids = to_device(list(tokens), logits.device, torch.long)
    got, top_i = logprobs_of(logits, ids, max(tops))
    values = got.tolist()  # [N, 1 + k]
    top_ids = top_i.tolist()
    return [
        TokenLogprob(t, v[0], tuple(zip(ti[:n], v[1 : 1 + n], strict=True)))
        for t, v, ti, n in zip(tokens, values, top_ids, tops, strict=True)
    ]


def logprobs_of(
    logits: torch.Tensor, ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: [N, 1 + k] fp32 each row's logprob of ``ids`` ([N]) then its top k's,
    and [N, k] those top ids, most likely first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1)
    top_v, top_i = logp.topk(k, dim=-1) if k else (logp[:, :0], ids[:, None][:, :0])
    return torch.cat([chosen.unsqueeze(1), top_v], dim=1), top_i
