"""What every attention backend shares: a step's sequences, metadata and groups. Token p of a
sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from models.layers import rotary_tables
from models.tree import TreeSpan


@dataclass(frozen=True)
class SeqSlice:
    """One sequence in a step; with ``tree``, the new tokens are its last ``num_new`` nodes."""

    block_table: Sequence[int]
    num_cached: int
    num_new: int
    tree: TreeSpan | None = None

    def __post_init__(self) -> None:
        t = self.tree
        if t is not None and not (
            t.base <= self.num_cached and t.base + t.size == self.num_cached + self.num_new
        ):
            raise ValueError(
                f"a tree over slots {t.base}..{t.base + t.size - 1} does not end with the "
                f"{self.num_new} new tokens after {self.num_cached} cached ones"
            )

    def positions(self) -> list[int]:
        if self.tree is None:
            return list(range(self.num_cached, self.num_cached + self.num_new))
        depths = self.tree.depths()[self.num_cached - self.tree.base :]
        return [self.tree.base + d for d in depths]


@dataclass(frozen=True)
class AttentionSpec:
    block_size: int
    group_size: int
    head_dim: int
    num_kv_heads: int
    num_blocks: int
    block_chunks: int
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    device: torch.device
    window: int | None = None


class AttentionGroup(Protocol):
    @property
    def rows(self) -> torch.Tensor | None:
        """[t] the group's tokens among the step's T; None: all of them, in order."""

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [t, Hq, D]; layer_kv: [NB, 2, Hkv, BS, D] -> [t, Hq * D]."""


class LayerAttention(Protocol):
    @property
    def spec(self) -> AttentionSpec: ...

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, layer_kv: torch.Tensor, meta: StepMetadata
    ) -> None: ...

    def attend(
        self, q: torch.Tensor, layer_kv: torch.Tensor, meta: StepMetadata, scale: float
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepMetadata:
    """Indices shared by every layer of one step (T new tokens; a bucket's T is ``b * q``)."""

    backend: LayerAttention
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    cos: torch.Tensor  # [T, 1, 2, head_dim / 2]
    sin: torch.Tensor
    groups: tuple[AttentionGroup, ...]
    # a bucket's padding rows write their source row's K/V again: [T] the row each write carries
    write_rows: torch.Tensor | None = None
    # the same step for a model's sliding-window layers (Gemma 3): its window and rope base
    local: StepMetadata | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class BucketInputs:
    """A bucketed step's device buffers: ``b`` sequences of ``q`` rows over ``nb`` blocks."""

    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    write_rows: torch.Tensor  # [b * q] the row whose K/V each write carries (padding: row 0)
    tables: torch.Tensor
    cached: torch.Tensor
    num_new: torch.Tensor  # [b] (a padding sequence brings 0)


@dataclass(frozen=True)
class StepLayout:
    seqs: Sequence[SeqSlice]
    need: list[int]
    tables: torch.Tensor
    starts: list[int]  # [B + 1] each sequence's first row in the step; the last: T

    def rows(self, members: Sequence[int]) -> torch.Tensor | None:
        """[t] the rows of ``seqs[members]``; None when they are the whole step in order."""
        if len(members) == len(self.seqs) and all(m == i for i, m in enumerate(members)):
            return None
        return torch.tensor(
            [r for i in members for r in range(self.starts[i], self.starts[i + 1])],
            dtype=torch.long,
        )

    def tables_of(self, members: Sequence[int]) -> torch.Tensor:
        if len(members) == len(self.seqs):
            return self.tables
        return self.tables[torch.tensor(list(members)), : max(self.need[i] for i in members)]


def step_layout(seqs: Sequence[SeqSlice], block_size: int) -> StepLayout:
    if not seqs or any(s.num_new <= 0 for s in seqs):
        raise ValueError("every sequence in a step must bring at least one new token")
    need = [(s.num_cached + s.num_new + block_size - 1) // block_size for s in seqs]
    width = max(need)
    rows: list[list[int]] = []
    for s, n in zip(seqs, need, strict=True):
        if len(s.block_table) < n:
            raise ValueError(f"block table holds {len(s.block_table)} blocks, step needs {n}")
        rows.append([*s.block_table[:n], *([0] * (width - n))])
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.num_new)
    return StepLayout(seqs, need, torch.tensor(rows, dtype=torch.long), starts)


def step_metadata(
    backend: LayerAttention, layout: StepLayout, groups: tuple[AttentionGroup, ...]
) -> StepMetadata:
    spec = backend.spec
    bs = spec.block_size
    positions = [p for s in layout.seqs for p in s.positions()]
    blocks: list[int] = []
    offsets: list[int] = []
    for s in layout.seqs:
        for slot in range(s.num_cached, s.num_cached + s.num_new):
            blocks.append(s.block_table[slot // bs])
            offsets.append(slot % bs)
    dev = spec.device
    pos = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
    cos, sin = rotary_tables(spec.rope_cos, spec.rope_sin, pos)
    return StepMetadata(
        backend=backend,
        positions=pos,
        slot_blocks=torch.tensor(blocks, dtype=torch.long).to(dev, non_blocking=True),
        slot_offsets=torch.tensor(offsets, dtype=torch.long).to(dev, non_blocking=True),
        cos=cos,
        sin=sin,
        groups=groups,
    )


def bucket_mask(bucket: BucketInputs, block_size: int, window: int | None) -> torch.Tensor:
    """[b, 1, q, nb * block_size] True where a row may attend, with device ops only; a padding
    row sees key 0 alone, so no softmax row is empty."""
    b, nb = bucket.tables.shape
    q = bucket.positions.shape[0] // b
    c = nb * block_size
    dev = bucket.positions.device
    q_idx = torch.arange(q, device=dev)
    q_pos = bucket.cached.view(b, 1) + q_idx.view(1, q)
    valid = q_idx.view(1, q) < bucket.num_new.view(b, 1)
    ctx = torch.arange(c, device=dev).view(1, 1, c)
    mask = ctx <= q_pos.unsqueeze(2)
    if window is not None:
        mask = mask & (ctx > q_pos.unsqueeze(2) - window)
    mask = (mask & valid.unsqueeze(2)) | (~valid.unsqueeze(2) & (ctx == 0))
    return mask.unsqueeze(1)


def bucket_metadata(
    backend: LayerAttention, bucket: BucketInputs, group: AttentionGroup
) -> StepMetadata:
    spec = backend.spec
    cos, sin = rotary_tables(spec.rope_cos, spec.rope_sin, bucket.positions)
    return StepMetadata(
        backend=backend,
        positions=bucket.positions,
        slot_blocks=bucket.slot_blocks,
        slot_offsets=bucket.slot_offsets,
        cos=cos,
        sin=sin,
        groups=(group,),
        write_rows=bucket.write_rows,
    )
