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
    queued: int = 0  # prompts waiting or partly computed
    prefills: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0  # prompt tokens served from the prefix cache
    leases_expired: int = 0
    heap_releases: int = 0  # times the idle worker gave free heap memory back (release_memory)
    heap_released_bytes: int = 0
