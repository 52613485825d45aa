"""A model whose layers attend two ways (Gemma 3: sliding-window layers with their own rope
base, and global ones): each step is planned by both backends, the local plan riding in the
global one's ``local``; each layer reads the one it needs, and both write the same slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from models.attention.backend import AttentionBackend
from models.attention.metadata import (
    AttentionGroup,
    BucketInputs,
    SeqSlice,
    StepLayout,
    StepMetadata,
)


class LayeredBackend(AttentionBackend):
    def __init__(self, full: AttentionBackend, local: AttentionBackend) -> None:
        super().__init__(full.spec)
        self.full, self.local = full, local
        self.name = f"{full.name} (sliding layers: {local.name})"

    @property
    def fallbacks(self) -> int:
        return self.full.fallbacks + self.local.fallbacks

    @property
    def compiles(self) -> int:
        return self.full.compiles + self.local.compiles

    def plan(self, seqs: Sequence[SeqSlice]) -> StepMetadata:
        return replace(self.full.plan(seqs), local=self.local.plan(seqs))

    def groups(self, layout: StepLayout) -> tuple[AttentionGroup, ...]:
        return self.full.groups(layout)

    def plan_bucket(self, bucket: BucketInputs) -> StepMetadata:
        return replace(self.full.plan_bucket(bucket), local=self.local.plan_bucket(bucket))

    def capture_failed(self, error: Exception) -> bool:
        full, local = self.full.capture_failed(error), self.local.capture_failed(error)
        return full or local

    def describe(self) -> str:
        return f"{self.full.describe()}; sliding layers: {self.local.describe()}"
