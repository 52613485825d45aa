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
    token: Any
    failed: bool = False


@dataclass
class TransferCounters:
    pulls_started: int = 0
    pulls_done: int = 0
    pulls_failed: int = 0
    bytes_pulled: int = 0
    seconds_pulling: float = 0.0
    exports_completed: int = 0
    state_unknown: int = 0  # asks for a read's state that raised: its blocks stay held
    failures_by_cause: dict[str, int] = field(default_factory=dict)

    def fail(self, cause: str) -> None:
        self.pulls_failed += 1
        self.failures_by_cause[cause] = self.failures_by_cause.get(cause, 0) + 1


class KVTransport(ABC):
    name: ClassVar[str]

    def __init__(self) -> None:
        self.counters = TransferCounters()

    @property
    def wire(self) -> str:
        """What a peer must speak: part of the KV compatibility record."""
        return self.name

    @abstractmethod
    def sources(self) -> tuple[KVSource, ...]:
        """Every rank's registered pool, in rank order, for handoffs."""

    @abstractmethod
    def completed(self) -> list[str]:
        """Request ids whose blocks a destination finished reading since the last call."""

    def export(self, request_id: str, blocks: Sequence[int], groups: Sequence[str]) -> Any:
        return None

    @abstractmethod
    def start_pull(self, handoff: KVHandoff, local_blocks: Sequence[int]) -> PullHandle:
        """Begin reading every group of ``handoff``'s blocks into ``local_blocks`` (same order)."""

    @abstractmethod
    def poll(self, pull: PullHandle) -> PullState:
        """Progress of ``pull``; never blocks."""

    def poll_many(self, pulls: Sequence[PullHandle]) -> list[PullState]:
        return [self.poll(p) for p in pulls]

    @abstractmethod
    def release(self, pull: PullHandle) -> bool:
        """Release what ``pull`` holds; True once no byte can land (until then keep its blocks)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the transport's own resources (agents, registrations)."""

    def progress(self) -> None:  # noqa: B027 - optional hook
        """Let the transport make progress between polls (e.g. drive its network stack)."""

    def wait(self, pull: PullHandle, timeout_s: float = 30.0) -> PullState:
        deadline = time.monotonic() + timeout_s
        while (state := self.poll(pull)) is PullState.PENDING:
            if time.monotonic() > deadline:
                return PullState.FAILED
            time.sleep(0.0002)
        return state
