"""Sampling primitives: the temperature/top-k/top-p transform and seeded draws.

The same :func:`probs_from_logits` turns target and draft logits into distributions, which is
what makes speculative decoding exact under truncated sampling. Randomness is drawn from
generators derived from ``(request seed, output position, stream)``, so a seeded request gives
the same tokens wherever it runs (prefill or decode replica) and whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    max_tokens: int = 16
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end-of-sequence ids included unless ignore_eos
    seeded: bool = False  # the client chose the seed: its tokens must not depend on the batch

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


class Stream:
    """Independent random streams of one output position."""

    SAMPLE = 0  # the plain sample / recovered or bonus token
    ACCEPT = 1  # uniforms of the accept test
    DRAFT = 2  # the drafter's own proposals


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def derived_seed(seed: int, position: int, stream: int) -> int:
    """A 63-bit seed that depends only on the request's seed, the output position and the stream."""
    return _splitmix64(_splitmix64(_splitmix64(seed & MASK64) ^ position) ^ stream) >> 1


def generator_for(
    seed: int, position: int, stream: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derived_seed(seed, position, stream))
    return g


def probs_from_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [N, V] float32, one row per params entry -> probabilities [N, V].

    Greedy rows become one-hot at the argmax; other rows are softmax(logits / T), truncated to
    the top-k tokens and then to the smallest set whose mass reaches top-p, and renormalized.
    """
    _n, v = logits.shape
    dev = logits.device
    greedy = torch.tensor([p.greedy for p in params], device=dev)  # [N]
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)  # [N, V]
    if any(p.truncates and not p.greedy for p in params):
        top_k = torch.tensor([p.top_k if p.top_k > 0 else v for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=probs.dtype)
        sorted_p, order = probs.sort(dim=-1, descending=True)  # [N, V]
        rank = torch.arange(v, device=dev).unsqueeze(0)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        keep = (rank < top_k.unsqueeze(1)) & (mass_before < top_p.unsqueeze(1))
        keep[:, 0] = True
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def sample_token(probs: torch.Tensor, params: SamplingParams, position: int, stream: int) -> int:
    """probs: [V] -> one token id: the argmax when greedy, else a draw from the generator of
    ``(params.seed, position, stream)``."""
    if params.greedy:
        return int(probs.argmax().item())
    gen = generator_for(params.seed, position, stream, probs.device)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def accept_uniforms(params: SamplingParams, first_position: int, count: int) -> torch.Tensor:
    """[count] uniforms for the accept tests at output positions first_position, +1, ...

    Greedy requests need no randomness (acceptance is then deterministic), so they get zeros.
    """
    if params.greedy:
        return torch.zeros(count)
    return (
        torch.cat(
            [
                torch.rand(
                    1, generator=generator_for(params.seed, first_position + j, Stream.ACCEPT)
                )
                for j in range(count)
            ]
        )
        if count
        else torch.zeros(0)
    )
