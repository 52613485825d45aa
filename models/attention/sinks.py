"""Attention with sinks (gpt-oss): each head has a learned logit that joins every query's
softmax as one more, value-less key, so a row may attend to nothing. The gather path's groups
hold each step's dense context and mask; their queries attend here, in the step's dtype."""

from __future__ import annotations

import torch

from models.attention.metadata import StepMetadata
from models.attention.reference import BucketGatherGroup, GatherGroup, gather


def _attend(
    queries: torch.Tensor,
    layer_kv: torch.Tensor,
    tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """queries [b, q, Hq, D], tables [b, NBmax], mask [b, 1, q, C], sinks [Hq]
    -> [b * q, Hq * D]."""
    b, qn, hq, d = queries.shape
    keys, values = gather(layer_kv, tables)  # [b, Hkv, C, D] each
    g = hq // keys.shape[1]
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    logits = queries.transpose(1, 2) @ keys.transpose(2, 3) * scale  # [b, Hq, q, C]
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, hq, 1, 1).expand(b, hq, qn, 1).to(logits.dtype)
    both = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(both - both.amax(-1, keepdim=True), dim=-1)[..., :-1]
    out: torch.Tensor = probs.to(values.dtype) @ values  # [b, Hq, q, D]
    return out.transpose(1, 2).reshape(b * qn, hq * d)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_kv: torch.Tensor,
    meta: StepMetadata,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """``paged_attention`` with sinks [Hq]: q [T, Hq, D]; k, v [T, Hkv, D] -> [T, Hq * D]."""
    meta.backend.write_kv(k, v, layer_kv, meta)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    for group in meta.groups:
        if isinstance(group, BucketGatherGroup):
            queries = q.view(group.num_seqs, group.max_query, *q.shape[1:])
            return _attend(queries, layer_kv, group.tables, group.mask, scale, sinks)
        if not isinstance(group, GatherGroup):
            raise TypeError(f"attention sinks need the gather path, not {type(group).__name__}")
        rows = group.rows
        part = q if rows is None else q[rows]
        got = group.unpad(
            _attend(group.pad(part), layer_kv, group.tables, group.mask, scale, sinks)
        )
        if rows is None:
            return got
        out[rows] = got
    return out
