"""Sampling primitives: the temperature/top-k/top-p transform and seeded draws.

The same :func:`probs_from_logits` turns target and draft logits into distributions, which is
what makes speculative decoding exact under truncated sampling. Randomness is drawn from
a counter-based generator keyed by ``(request seed, output position, stream)``, so a seeded
request gives the same tokens wherever it runs (prefill or decode replica) and whatever shares
its batch, and a batch's draws are computed at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

MASK63 = (1 << 63) - 1  # seeds are non-negative 63-bit ints


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
    # report each emitted token's log-probability and this many alternatives (models.logprobs);
    # None reports none
    logprobs: int | None = None
    # independent choices of the request (``n``); choice i > 0 samples with ``choice_seed``
    n: int = 1

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
    CHOICE = 3  # the seeds of a request's further choices (``choice_seed``; position: index)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """SplitMix64's finaliser over an array (uint64 arithmetic wraps modulo 2^64)."""
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
    out: npt.NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return out


def derived_seeds(
    seeds: npt.ArrayLike, positions: npt.ArrayLike, stream: int
) -> npt.NDArray[np.uint64]:
    """Per draw, a 64-bit value that depends only on the request's seed, the output position
    and the stream: a counter-based generator, so draws need no state and vectorise."""
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)  # a seed's low 64 bits
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    return _splitmix64(_splitmix64(_splitmix64(s) ^ pos) ^ np.uint64(stream))


def derived_seed(seed: int, position: int, stream: int) -> int:
    """``derived_seeds`` of one draw, as a 63-bit int."""
    return int(derived_seeds([seed & MASK63], [position], stream)[0]) >> 1


def choice_seed(seed: int, choice: int) -> int:
    """The seed of a request's choice ``choice`` (of ``n``): choice 0 samples with the request's
    own seed, so ``n = 1`` is unchanged; the others with seeds derived from it, so a seeded
    request with ``n > 1`` gives the same choices every time, each independent of the rest."""
    return seed if choice == 0 else derived_seed(seed, choice, Stream.CHOICE)


def uniforms(
    params: Sequence[SamplingParams], positions: Sequence[int], stream: int
) -> npt.NDArray[np.float64]:
    """[N] uniforms in [0, 1), one per (request, output position), from ``derived_seeds``
    (the top 53 bits); 0 for greedy requests, which draw nothing."""
    seeds = [p.seed & MASK63 for p in params]
    u = (derived_seeds(seeds, positions, stream) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=len(params))
    out: npt.NDArray[np.float64] = np.where(greedy, 0.0, u)
    return out


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


def sample_rows(
    probs: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int], stream: int
) -> torch.Tensor:
    """probs: [N, V] -> [N] token ids on probs' device: the argmax where greedy, else the
    inverse CDF of the row at the uniform of ``(seed, position, stream)`` (one host->device
    copy of N uniforms, no generator per draw)."""
    if all(p.greedy for p in params):
        return probs.argmax(dim=-1)
    u = torch.from_numpy(uniforms(params, positions, stream)).to(probs.device)  # [N]
    greedy = torch.tensor([p.greedy for p in params], device=probs.device)
    return torch.where(greedy, probs.argmax(dim=-1), inverse_cdf(probs, u))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [N, V], u: [N] in [0, 1) -> [N] the token where each row's cumulative mass first
    exceeds its uniform (in float64, so a long vocabulary's rounding stays far below any
    probability the draw could miss). A token of zero probability is never drawn."""
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    drawn = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)
    return drawn.squeeze(1).clamp(max=probs.shape[1] - 1)


def sample_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int], stream: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [N, V] -> ([N] token ids, [M, V] distributions of the M non-greedy rows in
    order, or None when every row is greedy). Greedy rows take the argmax of their logits and
    build no distribution: theirs is one-hot at that token."""
    tokens = logits.argmax(dim=-1)  # [N]
    sampled = [j for j, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens, None
    rows = torch.tensor(sampled, device=logits.device)
    sub = [params[j] for j in sampled]
    probs = probs_from_logits(logits[rows], sub)  # [M, V]
    tokens[rows] = sample_rows(probs, sub, [positions[j] for j in sampled], stream)
    return tokens, probs


def sample_token(probs: torch.Tensor, params: SamplingParams, position: int, stream: int) -> int:
    """probs: [V] -> one token id (``sample_rows`` of one row)."""
    return int(sample_rows(probs.unsqueeze(0), [params], [position], stream)[0])


def accept_uniforms(params: SamplingParams, first_position: int, count: int) -> torch.Tensor:
    """[count] uniforms for the accept tests at output positions first_position, +1, ...
    (zeros when greedy: acceptance is then deterministic)."""
    positions = range(first_position, first_position + count)
    return torch.from_numpy(uniforms([params] * count, positions, Stream.ACCEPT))
