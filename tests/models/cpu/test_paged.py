"""The CPU kernel that reads the KV pool in place (``models.cpu.paged``) against the gather path,
its batch invariance, and its named fallback where it cannot be built."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.attention.backend import AttentionBackend, paged_attention
from models.attention.metadata import SeqSlice
from models.attention.reference import ReferenceBackend
from models.cpu import native
from models.cpu.attention import CpuAttentionBackend
from models.cpu.paged import FLAGS, CpuPagedAttention, NativeGroup
from models.tree import TreeSpan
from tests.models.attention.cases import layer_spec

HKV, G, D, BS, NB = 2, 3, 16, 16, 160
CPU = torch.device("cpu")


def _in_block_major(layer: torch.Tensor) -> torch.Tensor:
    """``layer`` [NB, 2, HKV, BS, d] copied into the middle layer of a block-major pool of
    three layers, as ``kvtransfer.pool`` lays a pool out; the other layers hold NaN, so a read
    that strays into them shows."""
    pool = torch.full((layer.shape[0], 3, *layer.shape[1:]), float("nan"), dtype=layer.dtype)
    pool[:, 1] = layer
    return pool[:, 1]


def _step(
    seqs: list[SeqSlice],
    native: CpuPagedAttention | None,
    pool: torch.Tensor,
    q: torch.Tensor,
    window: int | None = None,
) -> tuple[torch.Tensor, int]:
    """One layer's attention over ``seqs``: [T, Hq * D], and how many groups the kernel ran."""
    t, d = q.shape[0], q.shape[-1]
    spec = layer_spec(pool, G, window)
    backend: AttentionBackend = (
        ReferenceBackend(spec) if native is None else CpuAttentionBackend(spec, kernel=native)
    )
    meta = backend.plan(seqs)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(t, HKV, d, generator=gen).to(pool.dtype)
    v = torch.randn(t, HKV, d, generator=gen).to(pool.dtype)
    out = paged_attention(q, k, v, pool, meta, d**-0.5)
    return out, sum(isinstance(g, NativeGroup) for g in meta.groups)


def _mixed_step(gen: torch.Generator) -> list[SeqSlice]:
    """Decodes, chain verifications, a draft tree, a short prompt chunk and a long one (400
    tokens: more rows than one call of the kernel's accumulators holds, so it is chunked), over
    blocks in shuffled order."""
    perm = (1 + torch.randperm(NB - 1, generator=gen)).tolist()
    shapes = [(300, 1), (517, 5), (16, 1), (250, 3), (40, 24), (0, 400), (7, 1)]
    seqs, start = [], 0
    for cached, new in shapes:
        n = (cached + new + BS - 1) // BS
        seqs.append(SeqSlice(perm[start : start + n], cached, new))
        start += n
    # a tree of 6 nodes after 100 cached tokens: two levels already cached, 4 new nodes
    tree = TreeSpan(98, (-1, 0, 1, 1, 2, 3))
    n = (98 + 6 + BS - 1) // BS
    seqs.append(SeqSlice(perm[start : start + n], 100, 4, tree))
    return seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("d", [D, 64])
@pytest.mark.parametrize("block_major", [False, True])
def test_in_place_equals_the_gather_path(
    dtype: torch.dtype, window: int | None, d: int, block_major: bool
) -> None:
    gen = torch.Generator().manual_seed(0)
    seqs = _mixed_step(gen)
    pool = torch.randn(NB, 2, HKV, BS, d, generator=gen).to(dtype)
    q = torch.randn(sum(s.num_new for s in seqs), HKV * G, d, generator=gen).to(dtype)
    kernel = CpuPagedAttention(G, d)
    mine = _in_block_major(pool) if block_major else pool.clone()
    got, native_groups = _step(seqs, kernel, mine, q, window)
    want, none = _step(seqs, None, pool.clone(), q, window)
    assert native_groups == 1 and none == 0
    written = pool.clone()
    _step(seqs, None, written, q, window)  # what the step writes into the pool
    assert torch.equal(mine, written)
    assert kernel.failed is None and kernel.fallbacks == 0 and kernel.calls == 1
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_a_head_dim_off_the_vector_width_gathers() -> None:
    """The kernel takes head dims that are multiples of 16; a model of another one gathers,
    and ``/health`` says why."""
    from models.config import LlamaConfig
    from models.kv_layout import kv_pool_shape
    from models.llama import LlamaModel
    from runtime.runner import LocalRunner

    seq = SeqSlice(list(range(4)), 40, 1)
    assert not CpuPagedAttention(G, 24).fits(BS, seq)
    assert CpuPagedAttention(G, 32).fits(BS, seq)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=96,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_ids=(0,),
    )
    model = LlamaModel(cfg)
    runner = LocalRunner(model, torch.zeros(kv_pool_shape(4, 2, 1, BS, 24)), BS)
    assert isinstance(runner.backend.attention, ReferenceBackend)
    assert not isinstance(runner.backend.attention, CpuAttentionBackend)
    assert "head dim 24" in str(runner.describe()["attention"])


def test_a_chunk_over_max_new_tokens_gathers_and_the_rest_is_one_call() -> None:
    gen = torch.Generator().manual_seed(2)
    seqs = _mixed_step(gen)
    kernel = CpuPagedAttention(G, D, max_new_tokens=300)
    layer = torch.zeros(NB, 2, HKV, BS, D)
    meta = CpuAttentionBackend(layer_spec(layer, G), kernel=kernel).plan(seqs)
    native = [g for g in meta.groups if isinstance(g, NativeGroup)]
    assert len(native) == 1
    assert native[0].cached.tolist() == [s.num_cached for s in seqs if s.num_new != 400]
    assert len(meta.groups) == 2  # the 400-token chunk alone takes the gather path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [D, 64, 128, 80])  # 64, 128: compiled as constants
def test_a_verified_row_gets_the_bits_of_its_decode_alone(dtype: torch.dtype, d: int) -> None:
    """k + 1 rows verified beside other sequences equal, bit for bit, each position decoded
    alone: what keeps greedy speculation token-identical without float64 attention. A key's
    score is computed with fifteen others where its whole block is visible to the row and by
    itself where it is not (the last block of each row here), with the same bits."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(NB, 2, HKV, BS, d, generator=gen).to(dtype)
    table = list(range(3, 3 + 25))
    other = SeqSlice(list(range(40, 60)), 290, 2)
    cached, k1 = 371, 5
    q = torch.randn(k1, HKV * G, d, generator=gen).to(dtype)
    q_other = torch.randn(2, HKV * G, d, generator=gen).to(dtype)
    kernel = CpuPagedAttention(G, d)
    backend = CpuAttentionBackend(layer_spec(pool, G), kernel=kernel)

    def attend(seqs: list[SeqSlice], queries: torch.Tensor) -> torch.Tensor:
        meta = backend.plan(seqs)
        assert isinstance(meta.groups[0], NativeGroup)
        return kernel.attend(queries, pool, meta.groups[0], d**-0.5)

    together = attend([other, SeqSlice(table, cached, k1)], torch.cat([q_other, q]))[2:]
    for t in range(k1):
        alone = attend([SeqSlice(table, cached + t, 1)], q[t : t + 1])
        assert torch.equal(alone[0], together[t]), f"row {t} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [D, 64])  # 64: a call holds 85 tokens of G = 3 rows
def test_a_long_prompt_chunk_gets_the_bits_of_each_position_alone(
    dtype: torch.dtype, d: int
) -> None:
    """A prompt chunk longer than one call's accumulators is cut into chunks of rows; each row
    must still get the bits it gets decoded alone, whatever chunk it falls in."""
    gen = torch.Generator().manual_seed(8)
    pool = torch.randn(NB, 2, HKV, BS, d, generator=gen).to(dtype)
    table = list(range(5, 5 + 30))
    cached, n = 37, 400
    q = torch.randn(n, HKV * G, d, generator=gen).to(dtype)
    kernel = CpuPagedAttention(G, d)
    backend = CpuAttentionBackend(layer_spec(pool, G), kernel=kernel)

    def attend(seq: SeqSlice, queries: torch.Tensor) -> torch.Tensor:
        meta = backend.plan([seq])
        assert len(meta.groups) == 1 and isinstance(meta.groups[0], NativeGroup)
        return kernel.attend(queries, pool, meta.groups[0], d**-0.5)

    whole = attend(SeqSlice(table, cached, n), q)
    for t in (0, 1, 84, 85, 86, 170, 255, 341, 342, 399):  # around the chunks' edges
        alone = attend(SeqSlice(table, cached + t, 1), q[t : t + 1])
        assert torch.equal(alone[0], whole[t]), f"row {t} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tree_node_gets_the_bits_of_the_chain_it_becomes(dtype: torch.dtype) -> None:
    """A draft tree's node attends to the same keys as its path laid out as a chain, but they
    sit at other slots (and so in other blocks): the kernel's result must not notice."""
    gen = torch.Generator().manual_seed(6)
    pool = torch.randn(NB, 2, HKV, BS, D, generator=gen).to(dtype)
    base = 37  # the tree starts mid-block
    tree = TreeSpan(base, (-1, 0, 0, 1, 2, 3, 3))  # node 5's path: 0, 1, 3, 5
    path = [0, 1, 3, 5]
    tree_table = list(range(10, 14))
    chain_table = list(range(50, 54))

    def copy(src: int, dst: int) -> None:  # slot src of the tree's blocks to dst of the chain's
        s_blk, d_blk = tree_table[src // BS], chain_table[dst // BS]
        pool[d_blk, :, :, dst % BS] = pool[s_blk, :, :, src % BS]  # [2, Hkv, D]

    for p in range(base):  # the same context in both layouts
        copy(p, p)
    for depth, node in enumerate(path):  # the path's keys and values, packed as a chain
        copy(base + node, base + depth)
    q = torch.randn(tree.size, HKV * G, D, generator=gen).to(dtype)
    kernel = CpuPagedAttention(G, D)
    backend = CpuAttentionBackend(layer_spec(pool, G), kernel=kernel)

    def attend(seq: SeqSlice, queries: torch.Tensor) -> torch.Tensor:
        meta = backend.plan([seq])
        assert isinstance(meta.groups[0], NativeGroup)
        return kernel.attend(queries, pool, meta.groups[0], D**-0.5)

    in_tree = attend(SeqSlice(tree_table, base, tree.size, tree), q)
    for depth, node in enumerate(path):
        in_chain = attend(SeqSlice(chain_table, base + depth, 1), q[node : node + 1])
        assert torch.equal(in_chain[0], in_tree[node]), f"node {node} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_major", [False, True])
def test_the_kv_write_puts_what_the_indexed_assignment_puts(
    dtype: torch.dtype, block_major: bool
) -> None:
    """The kernel's KV write against ``pool[blocks, :, :, offsets] = stack((k, v), 1)``, from
    strided views of one projection as the layer hands them over; it refuses what it does not
    take (the caller then assigns) and a slot outside the pool, before writing anything."""
    kernel = CpuPagedAttention(G, D)
    assert kernel.ready(), kernel.failed
    gen = torch.Generator().manual_seed(3)
    t = 7
    qkv = torch.randn(t, (G + 2) * HKV * D, generator=gen).to(dtype)  # [T, (Hq + 2 Hkv) D]
    k = qkv[:, G * HKV * D : (G + 1) * HKV * D].view(t, HKV, D)  # rows strided
    v = qkv[:, (G + 1) * HKV * D :].view(t, HKV, D)
    blocks = torch.randperm(NB, generator=gen)[:t]  # [T]
    offsets = torch.randint(0, BS, (t,), generator=gen)  # [T]
    want = torch.randn(NB, 2, HKV, BS, D, generator=gen).to(dtype)
    got = _in_block_major(want) if block_major else want.clone()
    want[blocks, :, :, offsets] = torch.stack((k, v), 1)
    assert kernel.write(k, v, got, blocks, offsets)
    assert torch.equal(got, want)
    assert not kernel.write(k, v, got, blocks.int(), offsets)  # int32 slots: not taken
    assert not kernel.write(
        k.float() if dtype != torch.float32 else k.double(), v, got, blocks, offsets
    )
    before = got.clone()
    with pytest.raises(IndexError, match=f"{NB} blocks"):
        kernel.write(k[:2], v[:2], got, torch.tensor([0, NB]), torch.tensor([0, 0]))
    assert torch.equal(got[1:], before[1:])  # only the slot before the bad one was written
    with pytest.raises(ValueError, match="7 keys, 7 values, 2 slots"):
        kernel.write(k, v, got, blocks[:2], offsets[:2])


def test_without_a_compiler_every_step_gathers_named_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(tmp_path / "cache"))
    gen = torch.Generator().manual_seed(4)
    seqs = _mixed_step(gen)
    pool = torch.randn(NB, 2, HKV, BS, D, generator=gen)
    q = torch.randn(sum(s.num_new for s in seqs), HKV * G, D, generator=gen)
    kernel = CpuPagedAttention(G, D)
    got, native_groups = _step(seqs, kernel, pool.clone(), q)
    want, _ = _step(seqs, None, pool.clone(), q)
    assert native_groups == 0 and kernel.calls == 0
    assert kernel.failed is not None and "no-such-cc" in kernel.failed
    _step(seqs, kernel, pool.clone(), q)
    assert kernel.fallbacks == 2  # one per step, and the build is not tried again
    torch.testing.assert_close(got, want)


def test_the_build_is_cached_per_source_and_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``native.build_library`` (which builds the kernel) on a small source, with the kernel's
    flags: a second call returns the same file untouched, a changed source builds anew, and no
    temporary is left behind. (Every kernel test builds the kernel itself, once a machine.)"""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(cache))
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 1; }\n")
    first = native.build_library(source, FLAGS)
    stamp = first.stat().st_mtime_ns
    again = native.build_library(source, FLAGS)
    assert again == first and again.stat().st_mtime_ns == stamp
    source.write_text("int probe(void) { return 2; }\n")
    changed = native.build_library(source, FLAGS)
    assert changed != first and first.exists()
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, changed.name])
