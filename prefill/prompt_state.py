"""A prompt's state inside the prefill worker, from ``submit`` to its handoff."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtransfer.handoff import KVHandoff
from models.request import Request

Done = Callable[[KVHandoff | BaseException], None]


@dataclass
class PromptState:
    req: Request
    on_done: Done
    hashes: list[bytes]  # prefix-cache keys of its full blocks (kvtransfer.allocator)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    admitted: bool = False
    target_logits: list[torch.Tensor] = field(default_factory=list)  # [w_i, V] per chunk
    positions: list[int] = field(default_factory=list)
    draft_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    draft_computed: int = 0
    last_feature: torch.Tensor | None = None  # [F] the target's features at the end

    @property
    def length(self) -> int:
        return len(self.req.prompt_token_ids)
