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
    """Tokens a drafter proposes for one request, and the distributions it drew them from."""

    tokens: tuple[int, ...]  # up to `width` tokens, possibly fewer (even none)
    probs: torch.Tensor | None  # [len(tokens), V] draft distributions; None: one-hot on `tokens`
    # A tree (greedy requests only): the parent of each token (-1: the newest known token),
    # parents first (models.tree); None: a chain, each token after the one before.
    parents: tuple[int, ...] | None = None


class Drafter(ABC):
    """Proposes continuation tokens for a batch of running requests.

    ``propose`` receives requests and, for each, the number of output positions the step will
    verify; it proposes tokens for the positions right after every known token
    (``len(output_token_ids)``, ``+1``, ...), and may stop early where it has nothing to
    propose. The proposal at a position must depend only on the tokens before it (never on how
    many positions were asked for; a drafter whose proposals also depend on where the step
    began declares ``step_dependent``), and be drawn with the generator of
    ``(seed, position, Stream.DRAFT)`` from ``probs``, computed under the request's own sampling
    transform (``models.sampling.probs_from_logits``): that keeps verification exact and seeded
    outputs independent of the step width. A drafter with its own KV keeps
    ``Request.num_draft_computed`` up to date; after verification the engine lowers that
    counter to the tokens that stayed valid.
    """

    #: whether the drafter owns the "draft" KV group of the pool
    uses_kv: bool = False
    #: whether ``observe`` wants the target's features (final hidden states)
    needs_features: bool = False
    #: whether a proposal depends on where the step began, not only on the tokens before it
    #: (an EAGLE head's later drafts read its own predicted features): then a seeded sampled
    #: request's tokens depend on its speculation lengths, which must not depend on the batch
    step_dependent: bool = False
    #: a model drafter's timing of its sequential rounds (``speculation.draft_cost``); None for
    #: drafters without a model forward
    rounds: DraftRounds | None = None

    def pays_rounds(self, req: Request) -> bool:
        """Whether drafting for ``req`` runs the model's sequential rounds (``rounds``)."""
        return self.rounds is not None

    @abstractmethod
    def propose(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        """One proposal per request, ``len(proposal.tokens) <= width``."""

    def propose_free(self, reqs: Sequence[Request], widths: Sequence[int]) -> list[DraftProposal]:
        """Proposals that run no model forward (for requests granted no drafts, whose first
        position is offered one only where that costs nothing): a drafter without rounds
        proposes as usual, a model drafter nothing."""
        if self.rounds is None:
            return self.propose(reqs, widths)
        return [DraftProposal((), None) for _ in reqs]

    def observe(self, req: Request, features: torch.Tensor) -> None:  # noqa: B027 - optional
        """features: [n, H], the target's final hidden states at the n positions it has just
        computed for ``req`` (continuing those already observed). Called only when
        ``needs_features``."""

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional
        """Drop what the drafter keeps about a request (finished, aborted or preempted)."""

    @property
    def tokens_fed(self) -> int:
        """Tokens this drafter has run through a model (0 for model-free drafters)."""
        return 0
