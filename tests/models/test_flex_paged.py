"""Attention that reads the pool in place (flex_attention) equals the gather path."""

from __future__ import annotations

import torch

from models.attention import SeqSlice, build_attention_metadata, paged_attention
from models.flex_paged import FlexPagedAttention, FlexPool
from models.layers import RotaryEmbedding

HKV, G, D, BS, NB = 2, 3, 16, 16, 96


def _step(
    seqs: list[SeqSlice], flex: FlexPool | None, pool: torch.Tensor, q: torch.Tensor
) -> tuple[torch.Tensor, int]:
    rope = RotaryEmbedding(D, 4096, 10000.0, torch.device("cpu"))
    meta = build_attention_metadata(seqs, BS, torch.device("cpu"), rope.cos, rope.sin, flex)
    t = q.shape[0]
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(t, HKV, D, generator=gen)
    v = torch.randn(t, HKV, D, generator=gen)
    out = paged_attention(q, k, v, pool, meta, D**-0.5)  # [T, Hq * D]
    return out, sum(g.flex is not None for g in meta.groups)


def test_in_place_attention_equals_the_gather_path() -> None:
    gen = torch.Generator().manual_seed(0)
    perm = (1 + torch.randperm(NB - 1, generator=gen)).tolist()
    # decodes and verifications over long contexts, and a prompt chunk the gather path keeps;
    # the first sequence's one (partial) block is block 0, which every padded table entry
    # names as well
    shapes = [(300, 1), (517, 5), (16, 1), (250, 3), (40, 24)]
    seqs, start = [SeqSlice([0], 5, 1)], 0
    for cached, new in shapes:
        n = (cached + new + BS - 1) // BS
        seqs.append(SeqSlice(perm[start : start + n], cached, new))
        start += n
    pool = torch.randn(NB, 2, HKV, BS, D, generator=gen)
    q = torch.randn(1 + sum(n for _, n in shapes), HKV * G, D, generator=gen)
    kernel = FlexPagedAttention(min_context_tokens=0)
    flex = FlexPool(kernel, HKV, NB, G)
    got, in_place = _step(seqs, flex, pool.clone(), q)
    want, none = _step(seqs, None, pool.clone(), q)
    assert in_place == 1 and none == 0  # every decode and verification in one group, in place
    assert kernel.failed is None and kernel.fallbacks == 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_short_contexts_keep_the_gather_path() -> None:
    kernel = FlexPagedAttention(min_context_tokens=1 << 20)
    flex = FlexPool(kernel, HKV, NB, G)
    pool = torch.zeros(NB, 2, HKV, BS, D)
    q = torch.zeros(1, HKV * G, D)
    _out, in_place = _step([SeqSlice([0, 1], 20, 1)], flex, pool, q)
    assert in_place == 0
