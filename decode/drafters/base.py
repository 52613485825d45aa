"""The drafter interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.request import Request


@dataclass(frozen=True)
class DraftProposal:
    """Tokens a drafter proposes for one request, and the distributions it drew them from."""

    tokens: tuple[int, ...]  # k_i tokens, possibly fewer than asked for (even none)
    probs: torch.Tensor | None  # [k_i, V] draft distributions; None means one-hot on `tokens`


class Drafter(ABC):
    """Proposes continuation tokens for a batch of running requests.

    ``propose`` receives requests whose target KV covers every known token but the last
    (``num_computed == num_tokens - 1``) together with the most tokens each may propose; it
    may return fewer. Proposals must be drawn from ``probs`` under the request's own sampling
    transform (``models.sampling.probs_from_logits``), which keeps verification exact. A
    drafter with its own KV keeps ``Request.num_draft_computed`` up to date; after
    verification the engine lowers that counter to the tokens that stayed valid.
    """

    #: whether the drafter owns the "draft" KV group of the pool
    uses_kv: bool = False

    @abstractmethod
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[DraftProposal]:
        """One proposal per request, ``len(proposal.tokens) <= k``."""

    @property
    def tokens_fed(self) -> int:
        """Tokens this drafter has run through a model (0 for model-free drafters)."""
        return 0
