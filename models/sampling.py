"""Sampling: one temperature/top-k/top-p transform for target and draft (which keeps speculation
exact under truncation), and draws keyed by ``(seed, output position, stream)``, so a seeded
request's tokens do not depend on where it runs or what shares its batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from models.device_copy import to_device
from models.grammar import GrammarSpec

MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. ``temperature == 0`` means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # end-of-sequence ids included unless ignore_eos
    seeded: bool = False  # the client chose the seed: its tokens must not depend on the batch
    # each token's log-probability and this many alternatives (None: none)
    logprobs: int | None = None
    n: int = 1
    # the logits processors (models/logits_processing.py), applied alike to target and draft
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0  # stop ids are barred until this many tokens are out
    min_p: float = 0.0  # stateless: applied after the temperature, with top-k and top-p
    allowed_token_ids: tuple[int, ...] = ()  # (): every id
    grammar: GrammarSpec | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def processes(self) -> bool:
        """Whether its logits depend on the tokens before each position (beyond the model)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
            or bool(self.allowed_token_ids)
            or self.grammar is not None
        )


class Stream:
    SAMPLE = 0
    ACCEPT = 1
    DRAFT = 2
    CHOICE = 3


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        x = x + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
    out: npt.NDArray[np.uint64] = x ^ (x >> np.uint64(31))
    return out


def derived_seeds(
    seeds: npt.ArrayLike, positions: npt.ArrayLike, stream: int
) -> npt.NDArray[np.uint64]:
    s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    return _splitmix64(_splitmix64(_splitmix64(s) ^ pos) ^ np.uint64(stream))


def derived_seed(seed: int, position: int, stream: int) -> int:
    return int(derived_seeds([seed & MASK63], [position], stream)[0]) >> 1


def choice_seed(seed: int, choice: int) -> int:
    """Choice 0 keeps the request's seed (``n = 1`` unchanged); the others derive theirs."""
    return seed if choice == 0 else derived_seed(seed, choice, Stream.CHOICE)


def uniforms(
    params: Sequence[SamplingParams], positions: Sequence[int], stream: int
) -> npt.NDArray[np.float64]:
    """[N] uniforms in [0, 1), one per (request, position); 0 for greedy requests."""
    seeds = [p.seed & MASK63 for p in params]
    u = (derived_seeds(seeds, positions, stream) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    greedy = np.fromiter((p.greedy for p in params), dtype=bool, count=len(params))
    out: npt.NDArray[np.float64] = np.where(greedy, 0.0, u)
    return out


def probs_from_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [N, V] float32 -> [N, V]: one-hot at the argmax where greedy, else softmax(x / T)
    without the tokens under min_p times the likeliest one's probability (vLLM's order),
    truncated to top-k, then to the smallest set reaching top-p, renormalized."""
    _n, v = logits.shape
    dev = logits.device
    greedy = to_device([p.greedy for p in params], dev)
    temps = to_device([p.temperature if not p.greedy else 1.0 for p in params], dev)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    if any(p.min_p > 0.0 and not p.greedy for p in params):
        min_p = to_device([p.min_p for p in params], dev, probs.dtype)
        floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)  # [N, 1]
        probs = torch.where(probs < floor, 0.0, probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(p.truncates and not p.greedy for p in params):
        top_k = to_device([p.top_k if p.top_k > 0 else v for p in params], dev)
        top_p = to_device([p.top_p for p in params], dev, probs.dtype)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(v, device=dev).unsqueeze(0)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        keep = (rank < top_k.unsqueeze(1)) & (mass_before < top_p.unsqueeze(1))
        keep[:, 0] = True
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if any(p.greedy for p in params):  # on the host: no device read
        one_hot = torch.zeros_like(probs)
        one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def sample_rows(
    probs: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int], stream: int
) -> torch.Tensor:
    """probs: [N, V] -> [N]: the argmax where greedy, else the inverse CDF at the row's uniform."""
    if all(p.greedy for p in params):
        return probs.argmax(dim=-1)
    u = torch.from_numpy(uniforms(params, positions, stream)).to(probs.device, non_blocking=True)
    greedy = to_device([p.greedy for p in params], probs.device)
    return torch.where(greedy, probs.argmax(dim=-1), inverse_cdf(probs, u))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [N, V], u: [N] -> [N], in float64; a zero-probability token is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)
    return drawn.squeeze(1).clamp(max=probs.shape[1] - 1)


def sample_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int], stream: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [N, V] -> ([N] tokens, [M, V] distributions of the M non-greedy rows, or None)."""
    tokens = logits.argmax(dim=-1)
    sampled = [j for j, p in enumerate(params) if not p.greedy]
    if not sampled:
        return tokens, None
    rows = to_device(sampled, logits.device)
    sub = [params[j] for j in sampled]
    probs = probs_from_logits(logits[rows], sub)
    tokens[rows] = sample_rows(probs, sub, [positions[j] for j in sampled], stream)
    return tokens, probs


def sample_token(probs: torch.Tensor, params: SamplingParams, position: int, stream: int) -> int:
    return int(sample_rows(probs.unsqueeze(0), [params], [position], stream)[0])


def accept_uniforms(params: SamplingParams, first_position: int, count: int) -> torch.Tensor:
    """[count] uniforms for the accept tests from ``first_position`` on (zeros when greedy)."""
    positions = range(first_position, first_position + count)
    return torch.from_numpy(uniforms([params] * count, positions, Stream.ACCEPT))
