"""The project's paged forward against transformers on the same weights (fp32, ≤ 1e-4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from models.cpu.row_ops import CpuRowOps
from models.kv_layout import kv_pool_shape
from models.llama import LlamaModel
from models.spec import ModelSpec
from runtime.runner import LocalRunner, SeqInput
from tests.helpers import serve_on_cpu

TOL = 1e-4
BS = 16


def _setup(folder: Path) -> tuple[LlamaModel, LlamaForCausalLM, torch.Tensor]:
    ours = ModelSpec(str(folder)).load()
    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    c = ours.cfg
    pool = torch.zeros(kv_pool_shape(64, c.num_kv_heads, c.num_layers, BS, c.head_dim))
    return ours, ref, pool


def _ref_logits(ref: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = ref(torch.tensor([ids])).logits[0]
    return out


@pytest.fixture(scope="module")
def embedded(embedded_folder: Path) -> tuple[LlamaModel, LlamaForCausalLM, torch.Tensor]:
    return _setup(embedded_folder)


@pytest.mark.parametrize("length", [1, 7, 16, 33, 130])
def test_prefill_matches_transformers(embedded: tuple, length: int) -> None:
    ours, ref, pool = embedded
    step = LocalRunner(ours, pool, BS).run
    ids = torch.randint(
        0, ours.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(length)
    ).tolist()
    table = list(range(40, 40 + (length + BS - 1) // BS))  # non-contiguous with block 0
    out = step([SeqInput(table, 0, ids, list(range(length)))])
    assert (out.logits - _ref_logits(ref, ids)).abs().max().item() <= TOL


def test_decode_and_verify_steps_append_to_cache(embedded: tuple) -> None:
    ours, ref, pool = embedded
    step = LocalRunner(ours, pool, BS).run
    ids = torch.randint(
        0, ours.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    expected = _ref_logits(ref, ids)
    table = [9, 3, 17, 5]  # blocks in arbitrary order
    step([SeqInput(table, 0, ids[:30], [29])])
    pos = 30
    for _ in range(3):  # single-token decode steps
        out = step([SeqInput(table, pos, ids[pos : pos + 1], [0])])
        assert (out.logits[0] - expected[pos]).abs().max().item() <= TOL
        pos += 1
    for k in (1, 4, 8):  # multi-token verification steps (k drafts + 1)
        n = k + 1
        out = step([SeqInput(table, pos, ids[pos : pos + n], list(range(n)))])
        assert (out.logits - expected[pos : pos + n]).abs().max().item() <= TOL
        pos += n


def test_ragged_batch_matches_each_sequence_alone(tiny_folder: Path) -> None:
    ours, ref, pool = _setup(tiny_folder)
    step = LocalRunner(ours, pool, BS).run
    gen = torch.Generator().manual_seed(3)
    seqs = [
        torch.randint(0, ours.cfg.vocab_size, (n,), generator=gen).tolist() for n in (20, 5, 37)
    ]
    tables = [[0, 1], [2], [3, 4, 5]]
    # a prompt chunk, a full prompt, and a longer prompt in one step
    batch = [SeqInput(t, 0, s[:-3], [len(s) - 4]) for t, s in zip(tables, seqs, strict=True)]
    out = step(batch)
    for row, s in enumerate(seqs):
        assert (out.logits[row] - _ref_logits(ref, s)[len(s) - 4]).abs().max().item() <= TOL
    # then 1, 2 and 3 new tokens per sequence in one ragged step
    batch = [
        SeqInput(t, len(s) - 3, s[len(s) - 3 : len(s) - 3 + j], list(range(j)))
        for j, t, s in zip((1, 2, 3), tables, seqs, strict=True)
    ]
    out = step(batch)
    rows = 0
    for j, s in zip((1, 2, 3), seqs, strict=True):
        want = _ref_logits(ref, s)[len(s) - 3 : len(s) - 3 + j]
        assert (out.logits[rows : rows + j] - want).abs().max().item() <= TOL
        rows += j


def test_interleaved_query_lengths_match_each_sequence_alone(tiny_folder: Path) -> None:
    """Sequences attended in separate groups (by new-token count) though interleaved in the
    batch: decodes, verifications and a prompt chunk in one step, each as if alone."""
    ours, ref, pool = _setup(tiny_folder)
    step = LocalRunner(ours, pool, BS).run
    gen = torch.Generator().manual_seed(5)
    news = (1, 20, 1, 4, 2, 5)
    cached = (9, 0, 30, 12, 17, 3)
    seqs = [
        torch.randint(0, ours.cfg.vocab_size, (c + n,), generator=gen).tolist()
        for c, n in zip(cached, news, strict=True)
    ]
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(seqs))]
    prefix = [
        SeqInput(t, 0, s[:c], [c - 1]) for t, s, c in zip(tables, seqs, cached, strict=True) if c
    ]
    step(prefix)  # the cached parts, ragged
    batch = [
        SeqInput(t, c, s[c:], list(range(n)))
        for t, s, c, n in zip(tables, seqs, cached, news, strict=True)
    ]
    out = step(batch)
    rows = 0
    for s, c, n in zip(seqs, cached, news, strict=True):
        want = _ref_logits(ref, s)[c : c + n]
        assert (out.logits[rows : rows + n] - want).abs().max().item() <= TOL
        rows += n


def test_untied_lm_head_loads(embedded_folder: Path, tmp_path: Path) -> None:
    from tests.helpers import make_tiny_checkpoint

    folder = make_tiny_checkpoint(tmp_path, embedded_folder, seed=5, tie=False)
    ours, ref, pool = _setup(folder)
    step = LocalRunner(ours, pool, BS).run
    ids = list(range(100, 120))
    out = step([SeqInput([0, 1], 0, ids, list(range(20)))])
    assert (out.logits - _ref_logits(ref, ids)).abs().max().item() <= TOL


def test_weights_packed_for_the_cpu_give_the_same_logits(tiny_folder: Path) -> None:
    """On the CPU a runtime packs every matmul weight for the panel kernel
    (``models.cpu.linear``): same logits (to float rounding) for a prompt and for a ragged
    decode step, and the plain weights are dropped."""
    plain = ModelSpec(str(tiny_folder)).load()
    packed = ModelSpec(str(tiny_folder)).load(ops=CpuRowOps())
    served = serve_on_cpu(packed, blocks=16)
    assert served.packed
    assert packed.layers[0].mlp.down_proj.weight.numel() == 0  # only the packing is kept
    c = plain.cfg
    shape = kv_pool_shape(16, c.num_kv_heads, c.num_layers, 16, c.head_dim)
    pools = [torch.zeros(shape), torch.zeros(shape)]
    prompt = [SeqInput([0, 1], 0, list(range(3, 23)), [19]), SeqInput([2], 0, [7, 8, 9], [2])]
    step = [SeqInput([0, 1], 20, [5, 6], [0, 1]), SeqInput([2], 3, [4], [0])]
    for batch in (prompt, step):
        a = LocalRunner(plain, pools[0], 16).run(batch)
        b = LocalRunner(packed, pools[1], 16, served).run(batch)
        torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(pools[1], pools[0], rtol=0, atol=1e-5)
