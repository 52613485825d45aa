"""A decode step launched and not yet read, for overlapped scheduling (``decode.overlap``):
while the device runs step n the host plans and launches step n + 1, its plain decodes fed the
tokens step n sampled straight from the device; step n is read after that. A request whose
step may go on unread holds a placeholder for its token until the read (``UNREAD``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from decode.scheduler import Planned
from decode.spec_step import Launched, SeqStep

UNREAD = -1  # a token the host has not read yet; fed to no model (the device has the token)


@dataclass(frozen=True, eq=False)
class Flight:
    plan: tuple[Planned, ...]
    launched: Launched
    # whether the next step may be planned before this one is read; not: some request in it
    # needs its tokens on the host first
    ahead: bool
    # per request id sampling in it (when ahead), where its placeholder sits in its outputs
    at: dict[str, int]
    # blocks released while it was in the air: it may still write them, so they are freed
    # once it has been read (a KV pull into a reused block is not ordered after the step)
    held: list[int] = field(default_factory=list)


def goes_on_unread(s: SeqStep, suspect: bool, source: bool) -> bool:
    """Whether the next step may be planned before ``s`` is read: no drafts, at most one
    token sampled (a decode, or a prompt's chunk; its logprobs, if asked, staged with its
    token) and logits that depend on the model only; ``suspect``: being re-run alone after a
    failed batch; ``source``: an n > 1 request's prompt, which ends once computed."""
    return (
        s.width <= 1
        and s.proposal.size == 0
        and not s.req.sampling.processes
        and not suspect
        and not source
    )
