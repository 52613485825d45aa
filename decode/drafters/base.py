"""The drafter interface."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.request import Request
from speculation.draft_cost import DraftRounds


@dataclass(frozen=True)
class DraftProposal:
    tokens: tuple[int, ...]
    probs: torch.Tensor | None  # [len(tokens), V] draft distributions; None: one-hot on `tokens`
    # a tree (greedy only): each token's parent, parents first (-1: the newest known token)
    parents: tuple[int, ...] | None = None
    # [n] a chain's tokens still on the device, read with the step's verification (``tokens``
    # is () until then): a drafter whose rounds fed each other on the device
    unread: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.tokens) if self.unread is None else self.unread.shape[0]


class Drafter(ABC):
    """Proposes tokens after each request's known tokens. A position's proposal depends only on the
    tokens before it (else ``step_dependent``) and is drawn with ``(seed, position, Stream.DRAFT)``
    from ``probs``; a drafter with its own KV keeps ``num_draft_computed`` current."""

    uses_kv: bool = False  # owns the pool's "draft" KV group
    needs_features: bool = False  # ``observe`` wants the target's final hidden states
    step_dependent: bool = False  # a proposal also depends on where the step began
    rounds: DraftRounds | None = None  # a model drafter's sequential rounds; None: no model

    def pays_rounds(self, req: Request) -> bool:
        return self.rounds is not None

    @abstractmethod
    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        """One proposal per request, ``len(proposal.tokens) <= width``."""

    def propose_free(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        """Proposals that run no model forward (for requests granted no drafts)."""
        if self.rounds is None:
            return self.propose(reqs, widths)
        return [DraftProposal((), None) for _ in reqs]

    def observe(self, req: Request, features: torch.Tensor) -> None:  # noqa: B027 - optional
        """features: [n, H], the target's final hidden states at ``req``'s new positions."""

    def settle(self) -> None:  # noqa: B027 - optional
        """The step has read its results from the device: time what the rounds ran there."""

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional
        """Drop what the drafter keeps about a request (finished, aborted or preempted)."""

    @property
    def tokens_fed(self) -> int:
        return 0

    def stop_chains_below(self, cutoff: float) -> None:  # noqa: B027 - optional
        """Cut each chain where its cumulative confidence falls under ``cutoff`` (a model
        drafter with probabilities; ``speculation.draft_stop``). 0: draft every granted token."""

    @property
    def positions_stopped(self) -> int:
        """Granted draft positions not drafted because a chain stopped early."""
        return 0
