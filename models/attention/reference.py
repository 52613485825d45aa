"""The reference backend: each group's blocks gathered into a dense copy, then SDPA. ``exact``
attends in float64, since SDPA rounds a row differently by how many rows share the call and 16-bit
models turn that into other greedy tokens; in float64 the difference vanishes on rounding back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.attention.backend import AttentionBackend
from models.attention.metadata import (
    AttentionGroup,
    AttentionSpec,
    BucketInputs,
    StepLayout,
    StepMetadata,
    bucket_mask,
    bucket_metadata,
)


def gather(layer_kv: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """layer_kv [NB, 2, Hkv, BS, D], tables [b, NBmax] -> [2, b, Hkv, NBmax * BS, D]."""
    _nb, _two, hkv, bs, d = layer_kv.shape
    b, nbmax = tables.shape
    out = torch.index_select(layer_kv.permute(1, 2, 0, 3, 4), 2, tables.reshape(-1))
    return out.view(2, hkv, b, nbmax * bs, d).transpose(1, 2)


def sdpa(
    queries: torch.Tensor,
    layer_kv: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    exact: bool,
) -> torch.Tensor:
    """queries [b, q, Hq, D], tables [b, NBmax], mask [b, 1, q, C] -> [b * q, Hq * D]."""
    b, qn, hq, d = queries.shape
    keys, values = gather(layer_kv, tables)  # [b, Hkv, C, D] each
    qs = queries.transpose(1, 2)
    if exact:
        qs, keys, values = qs.double(), keys.double(), values.double()
    out = F.scaled_dot_product_attention(
        qs, keys, values, attn_mask=mask, scale=scale, enable_gqa=hq != keys.shape[1]
    ).to(queries.dtype)
    return out.transpose(1, 2).reshape(b * qn, hq * d)


@dataclass(frozen=True)
class GatherGroup:
    """Sequences padded to one ``[b, q]`` query layout and one context of ``C`` keys."""

    rows: torch.Tensor | None
    tables: torch.Tensor
    token_index: torch.Tensor
    mask: torch.Tensor
    num_seqs: int
    max_query: int
    exact: bool

    @property
    def dense(self) -> bool:
        return self.num_seqs == 1

    def pad(self, q: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return q.unsqueeze(0)
        _t, hq, d = q.shape
        qp = q.new_zeros(self.num_seqs * self.max_query, hq, d)
        qp[self.token_index] = q
        return qp.view(self.num_seqs, self.max_query, hq, d)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.dense else out[self.token_index]

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        out = sdpa(self.pad(q), layer_kv, self.tables, self.mask, scale, self.exact)
        return self.unpad(out)


def gather_group(
    layout: StepLayout, members: Sequence[int], spec: AttentionSpec, exact: bool
) -> GatherGroup:
    part = [layout.seqs[i] for i in members]
    num_new = torch.tensor([s.num_new for s in part])
    cached = torch.tensor([s.num_cached for s in part])
    b, q = len(part), int(num_new.max())
    tables = layout.tables[torch.tensor(list(members)), : max(layout.need[i] for i in members)]
    c = tables.shape[1] * spec.block_size
    q_idx = torch.arange(q)
    q_valid = q_idx.unsqueeze(0) < num_new.unsqueeze(1)
    q_pos = cached.unsqueeze(1) + q_idx.unsqueeze(0)
    ctx_pos = torch.arange(c)
    mask = ctx_pos.view(1, 1, c) <= q_pos.unsqueeze(2)
    if spec.window is not None:
        mask &= ctx_pos.view(1, 1, c) > q_pos.unsqueeze(2) - spec.window
    for row, s in enumerate(part):
        if s.tree is not None:
            t = s.tree
            anc = t.ancestors()[s.num_cached - t.base :]
            mask[row, : s.num_new, t.base : t.base + t.size] &= anc
    # padded query rows attend to slot 0 only, so no softmax row is empty
    mask = (mask & q_valid.unsqueeze(2)) | (~q_valid.unsqueeze(2) & (ctx_pos == 0).view(1, 1, c))
    token_index = (torch.arange(b).unsqueeze(1) * q + q_idx.unsqueeze(0))[q_valid]
    rows = layout.rows(members)
    dev = spec.device

    def to_dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev, non_blocking=True)

    return GatherGroup(
        rows=None if rows is None else to_dev(rows),
        tables=to_dev(tables),
        token_index=to_dev(token_index),
        mask=to_dev(mask.unsqueeze(1)),
        num_seqs=b,
        max_query=q,
        exact=exact,
    )


def pow2(n: int) -> int:
    return (n - 1).bit_length()


def gather_groups(
    layout: StepLayout, members: Sequence[int], spec: AttentionSpec, exact: bool
) -> tuple[GatherGroup, ...]:
    by_bucket: dict[tuple[int, int], list[int]] = {}
    for i in members:
        key = (pow2(layout.seqs[i].num_new), pow2(layout.need[i]))
        by_bucket.setdefault(key, []).append(i)
    return tuple(gather_group(layout, m, spec, exact) for _, m in sorted(by_bucket.items()))


@dataclass(frozen=True)
class BucketGatherGroup:
    tables: torch.Tensor
    mask: torch.Tensor
    num_seqs: int
    max_query: int
    exact: bool
    rows: None = None

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        _t, hq, d = q.shape
        queries = q.view(self.num_seqs, self.max_query, hq, d)
        return sdpa(queries, layer_kv, self.tables, self.mask, scale, self.exact)


class ReferenceBackend(AttentionBackend):
    name = "gather"

    def __init__(self, spec: AttentionSpec, exact: bool = False, why: str | None = None) -> None:
        super().__init__(spec)
        self.exact = exact
        self.why = why

    def groups(self, layout: StepLayout) -> tuple[AttentionGroup, ...]:
        return gather_groups(layout, range(len(layout.seqs)), self.spec, self.exact)

    def bucket_group(self, bucket: BucketInputs) -> BucketGatherGroup:
        b, _nb = bucket.tables.shape
        return BucketGatherGroup(
            tables=bucket.tables,
            mask=bucket_mask(bucket, self.spec.block_size, self.spec.window),
            num_seqs=b,
            max_query=bucket.positions.shape[0] // b,
            exact=self.exact,
        )

    def plan_bucket(self, bucket: BucketInputs) -> StepMetadata:
        return bucket_metadata(self, bucket, self.bucket_group(bucket))

    def describe(self) -> str:
        return self.name if self.why is None else f"{self.name} ({self.why})"
