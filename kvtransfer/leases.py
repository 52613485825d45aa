from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    request_id: str
    blocks: tuple[int, ...]
    expires_at: float  # the owner's time.monotonic()


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, lease: Lease) -> None:
        if lease.request_id in self._leases:
            raise ValueError(f"request {lease.request_id} already holds a lease")
        self._leases[lease.request_id] = lease

    def pop(self, request_id: str) -> Lease | None:
        return self._leases.pop(request_id, None)

    def pop_expired(self, now: float) -> list[Lease]:
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.request_id]
        return expired

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.blocks) for lease in self._leases.values())
