"""Each decode step's work, first come, first served; blocks are reserved for every position it
may write (a tree's every node), preempting the newest running requests where they lack."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decode.speculation import SpeculationPolicy
from kvtransfer.allocator import BlockAllocator
from models.request import Request


@dataclass(frozen=True)
class Planned:
    req: Request
    new_tokens: int
    k: int  # draft tokens to verify beyond the pending one


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_batch_size: int,
        token_budget: int,
        max_model_len: int,
        speculation: SpeculationPolicy | None,
    ) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.max_model_len = max_model_len
        self.speculation = speculation

    def plan(self, running: Sequence[Request], preempt: Callable[[Request], None]) -> list[Planned]:
        chosen: list[tuple[Request, int]] = []
        budget = self.token_budget
        for r in running:
            if len(chosen) == self.max_batch_size or budget <= 0:
                break
            pending = r.num_tokens - r.num_computed
            new = min(pending, budget) if pending > 1 or not r.output_token_ids else 1
            chosen.append((r, new))
            budget -= new
        ks = self._drafts(chosen, budget)
        # reserve KV, preempting from the newest end: requests not chosen first
        idle = list(running[len(chosen) :])
        plan: list[Planned] = []
        i = 0
        while i < len(chosen):
            r, new = chosen[i]
            spec = self.speculation
            fed = ks[i] * spec.draft_width(r) if spec else 0
            need = math.ceil((r.num_computed + new + fed) / self.block_size) - len(r.block_table)
            while need > 0 and not self.allocator.can_allocate(need) and i < len(chosen):
                victim = idle.pop() if idle else chosen.pop()[0]
                preempt(victim)
            if i == len(chosen):
                break  # r itself had to go: everything after it already has
            if need > 0:
                r.block_table.extend(self.allocator.allocate(need))
            plan.append(Planned(r, new, ks[i]))
            i += 1
        return plan

    def _drafts(self, chosen: Sequence[tuple[Request, int]], budget: int) -> list[int]:
        ks = [0] * len(chosen)
        if self.speculation is None:
            return ks
        ready = [i for i, (r, new) in enumerate(chosen) if new == 1 and r.output_token_ids]
        if not ready:
            return ks
        caps = []
        for i in ready:
            r = chosen[i][0]
            room = min(
                r.sampling.max_tokens - len(r.output_token_ids), self.max_model_len - r.num_tokens
            )
            caps.append(max(0, room - 1))
        fixed = sum(new for i, (_, new) in enumerate(chosen) if i not in set(ready))
        got = self.speculation.choose(
            [chosen[i][0] for i in ready], caps, fixed, budget + len(ready)
        )
        for i, k in zip(ready, got, strict=True):
            ks[i] = k
        return ks
