"""Attention that reads the pool in place (the flex backend, ``models.attention.flex``) equals
the gather path."""

from __future__ import annotations

import pytest
import torch

from models.attention.backend import paged_attention
from models.attention.flex import FlexBackend, FlexBucketGroup, FlexGroup
from models.attention.flex_kernel import FlexKernel
from models.attention.metadata import BucketInputs, SeqSlice
from models.attention.reference import ReferenceBackend
from models.kv_layout import block_chunks
from models.tree import TreeSpan
from tests.models.attention.cases import layer_spec

pytestmark = pytest.mark.slow  # flex_attention compiles a kernel per shape on a CPU

HKV, G, D, BS, NB = 2, 3, 16, 16, 96
LAYERS = 3  # of a block-major pool, whose middle layer the tests read


def _layer(seed: int, block_major: bool) -> torch.Tensor:
    """One layer of a pool, [NB, 2, HKV, BS, D] of random values: a contiguous (layer-major)
    layer, or the middle layer of a block-major pool, its blocks LAYERS slabs apart."""
    gen = torch.Generator().manual_seed(seed)
    if not block_major:
        return torch.randn(NB, 2, HKV, BS, D, generator=gen)
    return torch.randn(NB, LAYERS, 2, HKV, BS, D, generator=gen)[:, LAYERS // 2]


def _backend(
    pool: torch.Tensor, kernel: FlexKernel | None, window: int | None = None
) -> ReferenceBackend:
    spec = layer_spec(pool, G, window)
    return ReferenceBackend(spec) if kernel is None else FlexBackend(spec, kernel)


def _step(
    seqs: list[SeqSlice],
    flex: FlexKernel | None,
    pool: torch.Tensor,
    q: torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, int]:
    meta = _backend(pool, flex, window).plan(seqs)
    t = q.shape[0]
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(t, HKV, D, generator=gen)
    v = torch.randn(t, HKV, D, generator=gen)
    out = paged_attention(q, k, v, pool, meta, D**-0.5)  # [T, Hq * D]
    return out, sum(isinstance(g, FlexGroup) and g.plan is not None for g in meta.groups)


@pytest.mark.parametrize("block_major", [False, True])
def test_in_place_attention_equals_the_gather_path(block_major: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    perm = (1 + torch.randperm(NB - 1, generator=gen)).tolist()
    # decodes and verifications over long contexts, and a prompt chunk; the first sequence's
    # one (partial) block is block 0, which every padded table entry names as well
    shapes = [(300, 1), (517, 5), (16, 1), (250, 3), (40, 24)]
    seqs, start = [SeqSlice([0], 5, 1)], 0
    for cached, new in shapes:
        n = (cached + new + BS - 1) // BS
        seqs.append(SeqSlice(perm[start : start + n], cached, new))
        start += n
    q = torch.randn(1 + sum(n for _, n in shapes), HKV * G, D, generator=gen)
    kernel = FlexKernel(min_context_tokens=0)
    pool = _layer(4, block_major)
    assert block_chunks(pool) == (LAYERS if block_major else 1) * 2 * HKV
    got, in_place = _step(seqs, kernel, pool, q)
    want, none = _step(seqs, None, _layer(4, block_major), q)
    assert in_place == 2 and none == 0  # short queries in one group, the prompt chunk in another
    assert kernel.failed is None and kernel.fallbacks == 0
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_failing_shape_gathers_alone_and_the_rest_stay_in_place() -> None:
    """A flex call that raises (here: planned over another pool than it reads) is logged and
    counted, that shape gathers from then on, and a step of another shape still runs in place,
    right: in this torch a valid call after a failed one returned wrong values (0.27 off) until
    dynamo's compiled state was reset, which the kernel now does on a failure."""
    gen = torch.Generator().manual_seed(3)
    seqs = [SeqSlice(list(range(1, 21)), 300, 1)]
    q = torch.randn(1, HKV * G, D, generator=gen)
    kernel = FlexKernel(min_context_tokens=0)
    small = _layer(5, False)
    meta = _backend(torch.zeros(2 * NB, 2, HKV, BS, D), kernel).plan(seqs)  # the wrong pool
    k, v = torch.randn(1, HKV, D, generator=gen), torch.randn(1, HKV, D, generator=gen)
    gathered = paged_attention(q, k, v, small.clone(), meta, D**-0.5)
    assert len(kernel.failed_shapes) == 1 and kernel.fallbacks == 1 and kernel.failed is None
    want = paged_attention(q, k, v, small.clone(), _backend(small, None).plan(seqs), D**-0.5)
    torch.testing.assert_close(gathered, want, atol=2e-5, rtol=1e-4)
    paged_attention(q, k, v, small.clone(), meta, D**-0.5)  # the failed shape: gathered
    assert kernel.fallbacks == 2 and len(kernel.failed_shapes) == 1
    got, in_place = _step(seqs, kernel, small.clone(), q)  # the pool's own shape: in place
    assert in_place == 1 and kernel.fallbacks == 2
    ref, _ = _step(seqs, None, small.clone(), q)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    assert "1 shapes gather after failing" in FlexBackend(layer_spec(small, G), kernel).describe()


def test_short_contexts_keep_the_gather_path_for_short_queries_alone() -> None:
    """Under ``min_context_tokens`` a decode gathers (measured faster on a GPU there); a prompt
    chunk reads in place whatever its context (gathering it costs its rows times its keys)."""
    kernel = FlexKernel(min_context_tokens=1 << 20)
    pool = torch.zeros(NB, 2, HKV, BS, D)
    q = torch.zeros(1, HKV * G, D)
    _out, in_place = _step([SeqSlice([0, 1], 20, 1)], kernel, pool, q)
    assert in_place == 0
    _out, in_place = _step([SeqSlice([0, 1], 0, 20)], kernel, pool, torch.zeros(20, HKV * G, D))
    assert in_place == 1


def test_large_trees_and_windowed_prompts_read_in_place() -> None:
    """A draft tree too wide for one query block (30 new nodes: two tiles of 21 tokens), beside
    a long prompt chunk, with and without a sliding window, equals the gather path."""
    gen = torch.Generator().manual_seed(11)
    parents = (-1, *(int(torch.randint(0, n, (1,), generator=gen)) for n in range(1, 32)))
    perm = (1 + torch.randperm(NB - 1, generator=gen)).tolist()
    tree = TreeSpan(130, parents)  # two nodes cached, 30 new
    seqs = [SeqSlice(perm[:11], 132, 30, tree), SeqSlice(perm[11:40], 190, 260)]
    q = torch.randn(290, HKV * G, D, generator=gen)
    for window in (None, 40):
        kernel = FlexKernel(min_context_tokens=0)
        got, in_place = _step(seqs, kernel, _layer(6, True), q, window)
        want, _ = _step(seqs, None, _layer(6, True), q, window)
        assert in_place == 1 and kernel.fallbacks == 0  # both sequences: tiles of 64 rows
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def _bucket(
    flex: FlexKernel | None,
    pool: torch.Tensor,
    q: torch.Tensor,
    tables: torch.Tensor,
    cached: torch.Tensor,
    num_new: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """One layer of a bucketed step's attention (``plan_bucket``): its rows' outputs."""
    b, nb = tables.shape
    qn = q.shape[0] // b
    j = torch.arange(qn)
    pos = (cached.view(b, 1) + j.view(1, qn)).reshape(-1)  # [b * q]
    valid = (j.view(1, qn) < num_new.view(b, 1)).reshape(-1)
    rows = torch.arange(b * qn)
    write_rows = torch.where(valid, rows, 0)
    blocks = tables.repeat_interleave(qn, 0).gather(1, (pos // BS).clamp(max=nb - 1).view(-1, 1))
    slot_blocks = torch.where(valid, blocks.view(-1), blocks.view(-1)[0])
    slot_offsets = torch.where(valid, pos % BS, pos[0] % BS)
    bucket = BucketInputs(pos, slot_blocks, slot_offsets, write_rows, tables, cached, num_new)
    meta = _backend(pool, flex, window).plan_bucket(bucket)
    in_place = isinstance(meta.groups[0], FlexBucketGroup)
    assert in_place == (flex is not None and flex.min_context_tokens == 0)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(b * qn, HKV, D, generator=gen)
    v = torch.randn(b * qn, HKV, D, generator=gen)
    out = paged_attention(q, k, v, pool, meta, D**-0.5)  # [b * q, Hq * D]
    return out[valid]


@pytest.mark.parametrize(("block_major", "window"), [(False, None), (True, None), (True, 40)])
def test_bucketed_in_place_attention_equals_the_gather_path(
    block_major: bool, window: int | None
) -> None:
    """A bucket's block mask, built from device tensors alone (what a CUDA graph holds), gives
    what the gather path gives: decodes and verifications, contexts that end inside a block
    or on its edge, a padding sequence, and a sliding window."""
    gen = torch.Generator().manual_seed(3)
    perm = (1 + torch.randperm(NB - 1, generator=gen)).tolist()
    for qn, cached_list, new_list in (
        (1, [300, 16, 47, 0], [1, 1, 1, 0]),  # decodes, one padding sequence
        (8, [517, 250, 31, 100], [5, 3, 8, 1]),  # verifications: G * 8 = 24 rows a block
    ):
        nb = 40
        tables = torch.zeros(len(cached_list), nb, dtype=torch.long)
        start = 0
        for i, (c, n) in enumerate(zip(cached_list, new_list, strict=True)):
            used = -(-(c + n) // BS)
            tables[i, :used] = torch.tensor(perm[start : start + used])
            start += used
        cached, num_new = torch.tensor(cached_list), torch.tensor(new_list)
        q = torch.randn(len(cached_list) * qn, HKV * G, D, generator=gen)
        kernel = FlexKernel(min_context_tokens=0)
        pool = _layer(qn, block_major)
        got = _bucket(kernel, pool, q, tables, cached, num_new, window)
        want = _bucket(None, _layer(qn, block_major), q, tables, cached, num_new, window)
        assert kernel.failed is None and kernel.fallbacks == 0
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_a_bucket_over_a_short_context_gathers() -> None:
    """A bucket spanning fewer context tokens than the kernel's threshold keeps the gather path
    (on a GPU it is the faster one there), and says so by planning nothing."""
    kernel = FlexKernel(min_context_tokens=4 * 40 * BS + 1)
    spec = layer_spec(torch.zeros(NB, 2, HKV, BS, D), G)
    tables = torch.zeros(4, 40, dtype=torch.long)
    cached, num_new = torch.tensor([30, 20, 10, 0]), torch.tensor([1, 1, 1, 0])
    assert kernel.plan_bucket(tables, cached, num_new, 1, spec) is None
    kernel.min_context_tokens = 4 * 40 * BS
    assert kernel.plan_bucket(tables, cached, num_new, 1, spec) is not None
    assert kernel.failed is None and kernel.fallbacks == 0
