"""Counters a prefill worker reports (``/health``, metrics, routing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillStats:
    num_blocks: int
    free_blocks: int = 0
    cached_blocks: int = 0  # free or owned blocks whose full-block prefix is cached
    leased_blocks: int = 0
    active_leases: int = 0
    queued: int = 0
    prefills: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    leases_expired: int = 0
    cooling_blocks: int = 0  # of expired leases, kept past the lease while a read may land
    heap_releases: int = 0
    heap_released_bytes: int = 0
