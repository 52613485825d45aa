"""The flex backend: decodes and chain verifications read the pool in place through
``flex_attention``; prompt chunks, trees, sliding windows and short contexts gather."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from models.attention.flex_kernel import FlexKernel, FlexPlan
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
    gathered: GatherGroup
    plan: FlexPlan | None  # None: more (sequence, head) pairs than the kernel serves
    kernel: FlexKernel

    @property
    def rows(self) -> torch.Tensor | None:
        return self.gathered.rows

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        g = self.gathered
        if self.plan is not None:
            qp = g.pad(q)
            found = self.kernel.attend(qp, layer_kv, self.plan, scale)
            if found is not None:
                b, qn, hq, d = qp.shape
                return g.unpad(found.reshape(b * qn, hq * d))
        return g.attend(q, layer_kv, scale)


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
        self.buckets_in_place = spec.window is None  # the block masks have no window

    @property
    def fallbacks(self) -> int:
        return self.kernel.fallbacks

    def groups(self, layout: StepLayout) -> tuple[AttentionGroup, ...]:
        spec, kernel = self.spec, self.kernel
        everyone = range(len(layout.seqs))
        if spec.window is not None:
            return gather_groups(layout, everyone, spec, exact=False)
        fits = [i for i in everyone if kernel.fits(spec.group_size, layout.seqs[i])]
        if not kernel.applies(sum(layout.need[i] for i in fits) * spec.block_size):
            fits = []
        rest = [i for i in everyone if i not in set(fits)]
        groups: tuple[AttentionGroup, ...] = gather_groups(layout, rest, spec, exact=False)
        if fits:
            gathered = gather_group(layout, fits, spec, exact=False)
            part = [layout.seqs[i] for i in fits]
            need = torch.tensor([layout.need[i] for i in fits])
            cached = torch.tensor([s.num_cached for s in part])
            tables = layout.tables[torch.tensor(fits), : max(layout.need[i] for i in fits)]
            plan = kernel.plan(tables, need, cached, spec)
            groups = (FlexGroup(gathered, plan, kernel), *groups)
        return groups

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
        return f"flex in place (decodes and verifications over long contexts), else gather{failing}"
