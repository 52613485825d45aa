"""The CPU attention backend: every step reads the pool in place, one C call per layer
(``models.cpu.paged``); what the kernel does not take gathers, counted."""

from __future__ import annotations

import torch

from models.attention.metadata import (
    AttentionGroup,
    AttentionSpec,
    BucketInputs,
    StepLayout,
    StepMetadata,
    bucket_metadata,
)
from models.attention.reference import ReferenceBackend, gather_groups
from models.cpu.paged import CpuPagedAttention, NativeGroup


class CpuAttentionBackend(ReferenceBackend):
    name = "cpu_paged"

    def __init__(
        self, spec: AttentionSpec, exact: bool = False, kernel: CpuPagedAttention | None = None
    ) -> None:
        self.kernel = kernel or CpuPagedAttention(spec.group_size, spec.head_dim)
        super().__init__(spec, exact=exact)

    @property
    def fallbacks(self) -> int:
        return self.kernel.fallbacks

    def groups(self, layout: StepLayout) -> tuple[AttentionGroup, ...]:
        kernel, spec = self.kernel, self.spec
        everyone = range(len(layout.seqs))
        on_cpu: list[int] = []
        if kernel.ready():
            on_cpu = [i for i in everyone if kernel.fits(spec.block_size, layout.seqs[i])]
        else:
            kernel.fallbacks += 1
        taken = set(on_cpu)
        rest = [i for i in everyone if i not in taken]
        groups: tuple[AttentionGroup, ...] = gather_groups(layout, rest, spec, self.exact)
        if on_cpu:
            part = [layout.seqs[i] for i in on_cpu]
            native = kernel.plan(part, layout.tables_of(on_cpu), layout.rows(on_cpu), spec.window)
            groups = (native, *groups)
        return groups

    def plan_bucket(self, bucket: BucketInputs) -> StepMetadata:
        if not self.kernel.ready():
            self.kernel.fallbacks += 1
            return super().plan_bucket(bucket)
        query = bucket.positions.shape[0] // bucket.tables.shape[0]
        group = self.kernel.plan_bucket(
            bucket.tables, bucket.cached, bucket.num_new, query, self.spec.window
        )
        return bucket_metadata(self, bucket, group)

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor, meta: StepMetadata
    ) -> None:
        first = meta.groups[0]
        if not (
            meta.write_rows is None
            and isinstance(first, NativeGroup)
            and self.kernel.write(k, v, layer_kv, meta.slot_blocks, meta.slot_offsets)
        ):
            super().write_kv(k, v, layer_kv, meta)

    def describe(self) -> str:
        return self.kernel.describe()
