"""The KV transport interface: how a prompt's blocks move from a prefill pool to a decode pool.

Source side (prefill): the transport registers the worker's pool once at start-up;
:meth:`KVTransport.source` describes it for handoffs; :meth:`KVTransport.completed` returns the
request ids whose blocks a destination has finished reading, so the source can end their leases;
the source calls it often (every millisecond or so while leases are open), because some transports
only serve reads while their source makes progress. Destination side (decode):
:meth:`KVTransport.start_pull` issues one batched read of a handoff's blocks into local blocks and
returns at once; :meth:`KVTransport.poll` reports progress without blocking, so pulls overlap with
decoding other requests; :meth:`KVTransport.release` releases what a pull held once its reads
have ended and says whether any byte can still land: the caller quarantines the blocks until it
cannot.

Thread contract: a transport object is used from one thread (the worker's engine thread).
"""

from __future__ import annotations

import enum
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtransfer.handoff import KVHandoff, KVSource


class PullState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class KVTransferError(RuntimeError):
    """A pull could not be started or did not complete."""


@dataclass(frozen=True)
class PullHandle:
    request_id: str
    nbytes: int
    started_at: float
    token: Any  # the transport's own handle
    failed: bool = False  # it could not start in full: it polls FAILED (release it all the same)


@dataclass
class TransferCounters:
    """What a transport has moved (destination side) and handed out (source side)."""

    pulls_started: int = 0
    pulls_done: int = 0
    pulls_failed: int = 0
    bytes_pulled: int = 0
    seconds_pulling: float = 0.0
    exports_completed: int = 0
    failures_by_cause: dict[str, int] = field(default_factory=dict)

    def fail(self, cause: str) -> None:
        self.pulls_failed += 1
        self.failures_by_cause[cause] = self.failures_by_cause.get(cause, 0) + 1


class KVTransport(ABC):
    """Moves KV blocks between the pools of two workers (see the module docstring)."""

    name: ClassVar[str]

    def __init__(self) -> None:
        self.counters = TransferCounters()

    @abstractmethod
    def sources(self) -> tuple[KVSource, ...]:
        """Describe the registered pool of every rank, in rank order, for handoffs."""

    @abstractmethod
    def completed(self) -> list[str]:
        """Request ids whose blocks a destination finished reading since the last call."""

    def export(self, request_id: str, blocks: Sequence[int], groups: Sequence[str]) -> Any:
        """Source side, once per handoff: what the handoff must carry besides the sources (a
        transport that copies the bytes out returns them here; one that reads in place, None)."""
        return None

    @abstractmethod
    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        """Begin reading every group of ``handoff``'s blocks into ``local_blocks`` (same order)."""

    @abstractmethod
    def poll(self, pull: PullHandle) -> PullState:
        """Non-blocking progress check."""

    def poll_many(self, pulls: Sequence[PullHandle]) -> list[PullState]:
        """Progress of several pulls (a transport spanning processes checks them in one go)."""
        return [self.poll(p) for p in pulls]

    @abstractmethod
    def release(self, pull: PullHandle) -> bool:
        """Release what ``pull`` holds whose reads have ended; True when the transport confirms
        no byte of it can land any more (its reads are done or failed), False while a read is
        still running (call again later: a running read is not cancelled). Until True, the
        pull's local blocks must not be freed or reused: a late read would overwrite another
        request's KV."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the transport's own resources (agents, registrations)."""

    def progress(self) -> None:  # noqa: B027 - optional hook
        """Let the transport make progress between polls (e.g. drive its network stack)."""

    def wait(self, pull: PullHandle, timeout_s: float = 30.0) -> PullState:
        """Poll until the pull leaves PENDING or ``timeout_s`` passes (for tools and tests)."""
        deadline = time.monotonic() + timeout_s
        while (state := self.poll(pull)) is PullState.PENDING:
            if time.monotonic() > deadline:
                return PullState.FAILED
            time.sleep(0.0002)
        return state
