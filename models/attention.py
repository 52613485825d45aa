"""Attention over a paged KV cache, in plain torch.

**KV pool layout** (one tensor per model, owned by ``kvtransfer``; passed in as an argument)::

    pool: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]

For each (layer, K or V, head) the blocks lie side by side, so a step gathers a sequence's
context with one ``index_select`` over whole blocks and hands attention a strided view — no
per-token copies. A block of one (layer, K/V, head) is a contiguous ``block_size * head_dim``
run; consecutive block ids are adjacent, so a transfer of a run of blocks merges into few
descriptors, and one rank's heads of a block are addressable on their own. Sequences own
blocks through a *block table*: token ``p`` of a sequence lives in block
``table[p // block_size]`` at offset ``p % block_size``.

A forward step may mix sequences with different numbers of new tokens (prompt chunks, one decode
token, k + 1 verification tokens). :class:`AttentionMetadata` is built once per step and shared
by all layers: where each new token's K/V is written, which blocks each sequence attends to,
the causal mask over them, and the rotary angles of the new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def kv_pool_shape(
    num_blocks: int, num_kv_heads: int, num_layers: int, block_size: int, head_dim: int
) -> tuple[int, int, int, int, int, int]:
    """The shape the model expects of a KV pool (see the module docstring)."""
    return (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)


@dataclass(frozen=True)
class SeqSlice:
    """One sequence in a forward step: `num_new` tokens after `num_cached` cached ones."""

    block_table: Sequence[int]
    num_cached: int
    num_new: int


@dataclass(frozen=True)
class AttentionMetadata:
    """Indices shared by every layer of one forward step (B sequences, T new tokens)."""

    positions: torch.Tensor  # [T] position of each new token in its sequence
    slot_blocks: torch.Tensor  # [T] block that receives each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that block
    tables: torch.Tensor  # [B, NBmax] each sequence's blocks (padded with block 0)
    token_index: torch.Tensor  # [T] index of each new token in the padded [B * Q] query layout
    mask: torch.Tensor  # [B, 1, Q, C] True where a query may attend; C = NBmax * block_size
    cos: torch.Tensor  # [T, 1, head_dim / 2] rotary cosines at the new tokens' positions
    sin: torch.Tensor  # [T, 1, head_dim / 2]
    num_seqs: int  # B
    max_query: int  # Q
    dense: bool  # B == 1 and no padding: the padded layout equals the flat one

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


def build_attention_metadata(
    seqs: Sequence[SeqSlice],
    block_size: int,
    device: torch.device,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
) -> AttentionMetadata:
    """Index tensors for one step over ``seqs`` (in the order their tokens appear in the batch)."""
    if not seqs or any(s.num_new <= 0 for s in seqs):
        raise ValueError("every sequence in a step must bring at least one new token")
    num_new = torch.tensor([s.num_new for s in seqs])  # [B]
    cached = torch.tensor([s.num_cached for s in seqs])  # [B]
    b, q = len(seqs), int(num_new.max())
    max_blocks = (int((cached + num_new).max()) + block_size - 1) // block_size
    c = max_blocks * block_size
    tables = torch.zeros(b, max_blocks, dtype=torch.long)  # [B, max_blocks]
    for i, s in enumerate(seqs):
        need = (s.num_cached + s.num_new + block_size - 1) // block_size
        if len(s.block_table) < need:
            raise ValueError(f"block table holds {len(s.block_table)} blocks, step needs {need}")
        tables[i, :need] = torch.tensor(list(s.block_table[:need]), dtype=torch.long)

    q_idx = torch.arange(q)  # [Q]
    q_valid = q_idx.unsqueeze(0) < num_new.unsqueeze(1)  # [B, Q]
    q_pos = cached.unsqueeze(1) + q_idx.unsqueeze(0)  # [B, Q]
    ctx_pos = torch.arange(c)  # [C]
    mask = ctx_pos.view(1, 1, c) <= q_pos.unsqueeze(2)  # [B, Q, C]
    # Padded query rows attend to slot 0 only, so no row of the softmax is empty (no NaN).
    mask = (mask & q_valid.unsqueeze(2)) | (~q_valid.unsqueeze(2) & (ctx_pos == 0).view(1, 1, c))

    positions = q_pos[q_valid]  # [T]
    seq_of_token = torch.arange(b).unsqueeze(1).expand(b, q)[q_valid]  # [T]
    slot_blocks = tables[seq_of_token, positions // block_size]
    token_index = (torch.arange(b).unsqueeze(1) * q + q_idx.unsqueeze(0))[q_valid]

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    pos_dev = dev(positions)
    return AttentionMetadata(
        positions=pos_dev,
        slot_blocks=dev(slot_blocks),
        slot_offsets=dev(positions % block_size),
        tables=dev(tables),
        token_index=dev(token_index),
        mask=dev(mask.unsqueeze(1)),
        cos=rope_cos[pos_dev].unsqueeze(1),
        sin=rope_sin[pos_dev].unsqueeze(1),
        num_seqs=b,
        max_query=q,
        dense=b == 1,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_kv: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the step's K/V into the pool, then attend over each sequence's cached context.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; layer_kv: [2, Hkv, num_blocks, block_size, D] (one layer
    of the pool). Returns [T, Hq * D].
    """
    _t, hq, d = q.shape
    hkv = k.shape[1]
    k_cache, v_cache = layer_kv[0], layer_kv[1]  # [Hkv, NB, BS, D] views into the pool
    k_cache[:, meta.slot_blocks, meta.slot_offsets] = k.transpose(0, 1)
    v_cache[:, meta.slot_blocks, meta.slot_offsets] = v.transpose(0, 1)
    b, qn = meta.num_seqs, meta.max_query
    flat = meta.tables.view(-1)  # [B * NBmax]
    c = meta.tables.shape[1] * k_cache.shape[2]
    # Whole blocks per head, end to end: [Hkv, B * NBmax, BS, D] -> [B, Hkv, C, D] (a view).
    keys = k_cache.index_select(1, flat).view(hkv, b, c, d).transpose(0, 1)
    values = v_cache.index_select(1, flat).view(hkv, b, c, d).transpose(0, 1)

    if meta.dense:
        qp = q.unsqueeze(0)  # [1, T, Hq, D]
    else:
        qp = q.new_zeros(b * qn, hq, d)
        qp[meta.token_index] = q
        qp = qp.view(b, qn, hq, d)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=hq != hkv
    )  # [B, Hq, Q, D]
    out = out.transpose(1, 2).reshape(b * qn, hq * d)
    return out if meta.dense else out[meta.token_index]
