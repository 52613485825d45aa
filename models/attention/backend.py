"""The interface every attention implementation sits behind: a step's metadata is planned once
and shared by every layer, which writes its K/V and attends through ``paged_attention``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from models.attention.metadata import (
    AttentionGroup,
    AttentionSpec,
    BucketInputs,
    SeqSlice,
    StepLayout,
    StepMetadata,
    step_layout,
    step_metadata,
)


class AttentionBackend(ABC):
    """Paged attention for one model over one pool (``spec``), chosen once per model; what it
    cannot serve goes to the reference path and is counted in ``fallbacks``."""

    name: str

    def __init__(self, spec: AttentionSpec) -> None:
        self.spec = spec

    @property
    def fallbacks(self) -> int:
        """Steps or groups the reference path served because this backend's kernel failed."""
        return 0

    @property
    def compiles(self) -> int:
        """Kernels compiled so far (each a shape a step waited on); 0 where nothing compiles."""
        return 0

    def plan(self, seqs: Sequence[SeqSlice]) -> StepMetadata:
        """A ragged step's metadata, ``seqs`` in the order of their tokens."""
        layout = step_layout(seqs, self.spec.block_size)
        return step_metadata(self, layout, self.groups(layout))

    @abstractmethod
    def groups(self, layout: StepLayout) -> tuple[AttentionGroup, ...]:
        """How the step's sequences are attended, in groups that cover every row."""

    @abstractmethod
    def plan_bucket(self, bucket: BucketInputs) -> StepMetadata:
        """The metadata of a bucketed step, with device ops only."""

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor, meta: StepMetadata
    ) -> None:
        """k, v: [T, Hkv, D] into layer_kv [NB, 2, Hkv, BS, D] at the step's slots."""
        new = torch.stack((k, v), 1)
        if meta.write_rows is not None:
            new = new[meta.write_rows]
        layer_kv[meta.slot_blocks, :, :, meta.slot_offsets] = new

    def attend(
        self, q: torch.Tensor, layer_kv: torch.Tensor, meta: StepMetadata, scale: float
    ) -> torch.Tensor:
        """q: [T, Hq, D] -> [T, Hq * D], each group over its rows."""
        if len(meta.groups) == 1 and meta.groups[0].rows is None:
            return meta.groups[0].attend(q, layer_kv, scale)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for g in meta.groups:
            rows = g.rows
            assert rows is not None
            out[rows] = g.attend(q[rows], layer_kv, scale)
        return out

    def capture_failed(self, error: Exception) -> bool:
        """A bucket's capture raised ``error``: True when the backend switched to a path that
        captures (the runner captures again); False re-raises."""
        return False

    def describe(self) -> str:
        return self.name


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_kv: torch.Tensor,
    meta: StepMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D], written first -> [T, Hq * D]."""
    meta.backend.write_kv(k, v, layer_kv, meta)
    return meta.backend.attend(q, layer_kv, meta, scale)
