"""The flex backend: every step reads the pool in place through ``flex_attention`` (decodes,
verifications and draft trees in query blocks of 16 rows, prompt chunks in tiles of 64), but
for short queries over short contexts, which gather where that measured faster."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from models.attention.flex_kernel import FlexKernel
from models.attention.flex_plan import PROMPT_QUERY_BLOCK, QUERY_BLOCK, FlexPlan
from models.attention.metadata import (
    AttentionGroup,
    AttentionSpec,
    BucketInputs,
    StepLayout,
    StepMetadata,
    bucket_metadata,
)
from models.attention.reference import (
    BucketGatherGroup,
    GatherGroup,
    ReferenceBackend,
    gather_group,
    gather_groups,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlexGroup:
    """Sequences of a ragged step read in place; their gather group is built only if the
    kernel fails."""

    layout: StepLayout
    members: tuple[int, ...]
    spec: AttentionSpec
    plan: FlexPlan
    kernel: FlexKernel

    @cached_property
    def rows(self) -> torch.Tensor | None:
        rows = self.layout.rows(self.members)
        return None if rows is None else rows.to(self.spec.device, non_blocking=True)

    @cached_property
    def gathered(self) -> GatherGroup:
        return gather_group(self.layout, self.members, self.spec, exact=False)

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        found = self.kernel.attend_rows(q, layer_kv, self.plan, scale)
        return self.gathered.attend(q, layer_kv, scale) if found is None else found


@dataclass(frozen=True)
class FlexBucketGroup:
    plan: FlexPlan
    kernel: FlexKernel
    gathered: BucketGatherGroup
    rows: None = None

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        g = self.gathered
        _t, hq, d = q.shape
        queries = q.view(g.num_seqs, g.max_query, hq, d)
        found = self.kernel.attend(queries, layer_kv, self.plan, scale)
        if found is not None:
            return found.reshape(g.num_seqs * g.max_query, hq * d)
        return g.attend(q, layer_kv, scale)


class FlexBackend(ReferenceBackend):
    name = "flex"

    def __init__(self, spec: AttentionSpec, kernel: FlexKernel | None = None) -> None:
        self.kernel = kernel or FlexKernel()
        super().__init__(spec, exact=False)
        self.buckets_in_place = True

    @property
    def fallbacks(self) -> int:
        return self.kernel.fallbacks

    @property
    def compiles(self) -> int:
        return self.kernel.compiles

    def groups(self, layout: StepLayout) -> tuple[AttentionGroup, ...]:
        spec, kernel = self.spec, self.kernel
        everyone = range(len(layout.seqs))
        short = [i for i in everyone if kernel.short(spec.group_size, layout.seqs[i])]
        if not kernel.applies(sum(layout.need[i] for i in short) * spec.block_size):
            short = []
        long = [i for i in everyone if not kernel.short(spec.group_size, layout.seqs[i])]
        groups: list[AttentionGroup] = []
        gathered: list[int] = [i for i in everyone if i not in set(short) | set(long)]
        for members, query_block in ((short, QUERY_BLOCK), (long, PROMPT_QUERY_BLOCK)):
            plan = self._plan(layout, members, query_block)
            if plan is None:
                gathered += members
            else:
                groups.append(FlexGroup(layout, tuple(members), spec, plan, kernel))
        return (*groups, *gather_groups(layout, sorted(gathered), spec, exact=False))

    def _plan(
        self, layout: StepLayout, members: Sequence[int], query_block: int
    ) -> FlexPlan | None:
        if not members:
            return None
        seqs = [layout.seqs[i] for i in members]
        return self.kernel.plan(seqs, layout.tables_of(members), self.spec, query_block)

    def plan_bucket(self, bucket: BucketInputs) -> StepMetadata:
        gathered = self.bucket_group(bucket)
        plan = None
        if self.buckets_in_place:
            query = bucket.positions.shape[0] // bucket.tables.shape[0]
            plan = self.kernel.plan_bucket(
                bucket.tables, bucket.cached, bucket.num_new, query, self.spec
            )
        group: AttentionGroup = (
            gathered if plan is None else FlexBucketGroup(plan, self.kernel, gathered)
        )
        return bucket_metadata(self, bucket, group)

    def capture_failed(self, error: Exception) -> bool:
        """Buckets gather from now on (a torch whose flex_attention waits on the device)."""
        if not self.buckets_in_place:
            return False
        log.error("graph capture with in-place attention failed, buckets gather: %s", error)
        self.kernel.failed = self.kernel.failed or f"graph capture: {error}"[:500]
        self.kernel.fallbacks += 1
        self.buckets_in_place = False
        return True

    def describe(self) -> str:
        k = self.kernel
        if k.failed is not None:
            return f"gather (flex unavailable: {k.failed})"
        failing = (
            f"; {len(k.failed_shapes)} shapes gather after failing, first: "
            f"{next(iter(k.failed_shapes.values()))}"
            if k.failed_shapes
            else ""
        )
        short = f"short queries over under {k.min_context_tokens} context tokens gather"
        return f"flex in place ({short}){failing}"
