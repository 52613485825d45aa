"""Bucketed steps (persistent buffers, padded shapes) against the ragged path: the same logits,
features and K/V, padding that writes no slot the step does not own, and the steps it cannot
bucket left to the ragged path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.attention.flex import FlexBackend
from models.attention.flex_kernel import FlexKernel
from models.backend import TorchBackend
from models.kv_layout import kv_pool_shape
from models.llama import LlamaModel
from models.spec import ModelSpec
from models.tree import TreeSpan
from runtime.backends import model_attention_spec
from runtime.bucketed import BucketedRunner
from runtime.runner import LocalRunner, SeqInput
from runtime.step_buffers import Bucket, StepBuffers, bucket_size

BS = 16


@pytest.fixture(scope="module")
def model(tiny_folder: Path) -> LlamaModel:
    return ModelSpec(str(tiny_folder)).load("cpu")


def _pools(model: LlamaModel) -> tuple[torch.Tensor, torch.Tensor]:
    """Two equal pools of random bytes: a slot the step must not write keeps its value."""
    c = model.cfg
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(kv_pool_shape(40, c.num_kv_heads, c.num_layers, BS, c.head_dim), generator=g)
    return pool, pool.clone()


def _written(batch: list[SeqInput], pool: torch.Tensor) -> torch.Tensor:
    """[NB, BS] True at every slot the batch's new tokens write."""
    mask = torch.zeros(pool.shape[1], BS, dtype=torch.bool)
    for s in batch:
        for p in range(s.num_cached, s.num_cached + len(s.token_ids)):
            mask[s.block_table[p // BS], p % BS] = True
    return mask


@pytest.mark.parametrize("ids_on_device", [False, True])
def test_bucketed_steps_equal_the_ragged_path(model: LlamaModel, ids_on_device: bool) -> None:
    """``ids_on_device``: the bucketed steps take their tokens as a tensor (drafts not read
    yet), their ``token_ids`` placeholders; they stay bucketed."""
    ragged_pool, bucket_pool = _pools(model)
    ragged = LocalRunner(model, ragged_pool, BS)
    bucketed = BucketedRunner(model, bucket_pool, BS, max_seqs=8, max_query=4, max_blocks=8)
    g = torch.Generator().manual_seed(1)
    tables = [[3, 9, 4, 20], [7, 1], [12, 30, 31], [5, 6, 8, 10, 11]]
    cached = [40, 17, 33, 70]
    written = torch.zeros(bucket_pool.shape[1], BS, dtype=torch.bool)  # slots written so far
    for step, widths in enumerate([[1, 1, 1, 1], [3, 1, 4, 2], [1, 2], [4, 4, 4, 1]]):
        batch = []
        for i, w in enumerate(widths):
            ids = torch.randint(3, 40000, (w,), generator=g).tolist()
            batch.append(SeqInput(tables[i], cached[i], ids, list(range(w))))
        want = ragged.run(batch)
        if ids_on_device:
            ids = torch.tensor([t for s in batch for t in s.token_ids])  # [T]
            blank = [replace(s, token_ids=[0] * len(s.token_ids)) for s in batch]
            got = bucketed.run(blank, ids)
        else:
            got = bucketed.run(batch)
        assert got.rows_per_seq == want.rows_per_seq
        assert (got.logits - want.logits).abs().max() <= 1e-4, step
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        assert (got.all_hidden - want.all_hidden).abs().max() <= 1e-4
        # the same K/V where the steps wrote, and not one other slot touched by padding
        written |= _written(batch, bucket_pool)
        assert (bucket_pool - ragged_pool).abs().max() <= 1e-4
        untouched = ~written.view(1, -1, 1, 1, BS, 1).expand_as(bucket_pool)
        assert torch.equal(bucket_pool[untouched], ragged_pool[untouched])
        for i, w in enumerate(widths):
            cached[i] += w
    assert bucketed.bucketed_steps == 4 and bucketed.ragged_steps == 0
    assert bucketed.describe()["graphs"] == "off"  # CUDA graphs: on a GPU only


@pytest.mark.slow  # flex_attention compiles a kernel per bucket on a CPU
def test_buckets_reading_the_pool_through_flex_attention_equal_the_ragged_path(
    tiny_folder: Path,
) -> None:
    """The GPU's bucketed attention (``flex_attention`` over the pool, its block mask built
    from the buffers by device ops), run here on the CPU: the logits and K/V of the ragged
    path, decodes and verifications, over several steps."""
    model = ModelSpec(str(tiny_folder)).load("cpu")
    ragged_pool, bucket_pool = _pools(model)
    # the GPU's backend, here: these contexts are short, so read them in place too
    kernel = FlexKernel(min_context_tokens=0)
    flex = FlexBackend(model_attention_spec(model, bucket_pool, BS), kernel)
    ragged = LocalRunner(model, ragged_pool, BS, TorchBackend(model, flex))
    bucketed = BucketedRunner(model, bucket_pool, BS, 4, 4, 8, backend=TorchBackend(model, flex))
    g = torch.Generator().manual_seed(5)
    tables = [[3, 9, 4, 20], [7, 1], [12, 30, 31]]
    cached = [40, 17, 33]
    for widths in ([1, 1, 1], [3, 1, 4], [1, 2, 1]):
        batch = []
        for i, w in enumerate(widths):
            ids = torch.randint(3, 40000, (w,), generator=g).tolist()
            batch.append(SeqInput(tables[i], cached[i], ids, list(range(w))))
            cached[i] += w
        want, got = ragged.run(batch), bucketed.run(batch)
        assert (got.logits - want.logits).abs().max() <= 1e-4
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        assert (bucket_pool - ragged_pool).abs().max() <= 1e-4
    assert kernel.failed is None and kernel.fallbacks == 0
    assert bucketed.bucketed_steps == 3


def test_prompts_trees_and_oversized_steps_take_the_ragged_path(model: LlamaModel) -> None:
    _, pool = _pools(model)
    runner = BucketedRunner(model, pool, BS, max_seqs=2, max_query=4, max_blocks=4)
    prompt = SeqInput([1, 2], 0, list(range(5, 25)), [19])  # a prompt from its start
    tree = SeqInput([3], 3, [7, 8, 9], [0, 1, 2], TreeSpan(2, (-1, 0, 0, 1)))
    wide = SeqInput([4], 2, [1, 2, 3, 4, 5], [4])  # more new tokens than max_query
    long = SeqInput([5, 6, 7, 8, 9], 70, [1], [0])  # more blocks than max_blocks
    crowd = [SeqInput([i + 10], 3, [1], [0]) for i in range(3)]  # more sequences
    for batch in ([prompt], [tree], [wide], [long], crowd):
        runner.run(batch)
    assert runner.ragged_steps == 5 and runner.bucketed_steps == 0


def test_buckets_are_powers_of_two_within_the_buffers() -> None:
    assert [bucket_size(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert bucket_size(5, 6) == 6  # capped at the buffers' size
    bufs = StepBuffers(8, 4, 16, BS, torch.device("cpu"))
    filled = bufs.fill([SeqInput([2, 5, 7], 35, [4, 5, 6], [0, 1, 2]), SeqInput([1], 3, [9], [0])])
    assert filled.bucket == Bucket(seqs=2, query=4, blocks=4)
    v = bufs.views(filled.bucket)
    # row 1 * 4 + 0 is the second sequence's token; rows 3 and 5..7 are padding: row 0's write
    assert v.write_rows.tolist() == [0, 1, 2, 0, 4, 0, 0, 0]
    assert v.slot_blocks.tolist() == [7, 7, 7, 7, 1, 7, 7, 7]
    assert v.slot_offsets.tolist() == [3, 4, 5, 3, 3, 3, 3, 3]
    assert v.tables.tolist() == [[2, 5, 7, 0], [1, 0, 0, 0]]
    assert bufs.logit_rows(filled).tolist() == [0, 1, 2, 4]
    assert bufs.token_rows(filled).tolist() == [0, 1, 2, 4]


def test_an_engine_with_bucketed_steps_decodes_what_the_ragged_one_does(tiny_folder: Path) -> None:
    """Greedy and seeded sampled requests with n-gram speculation (verifications of several
    widths): the same tokens with bucketed steps as with ragged ones."""
    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.sampling import SamplingParams
    from models.spec import DraftKind, DraftSpec
    from tests.decode.engine_utils import make_request, run_all

    g = torch.Generator().manual_seed(3)
    head = torch.randint(3, 40000, (9,), generator=g).tolist()
    prompts = [head * 3, torch.randint(3, 40000, (30,), generator=g).tolist(), head * 2 + [5]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=4, seeded=True),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    spec = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=3)
    outs = {}
    for shapes in ("ragged", "bucketed"):
        cfg = DecodeEngineConfig(
            "t", ModelSpec(str(tiny_folder)), spec, num_blocks=64, max_model_len=131072
        )
        engine = DecodeEngine(replace(cfg, step_shapes=shapes))
        assert engine.cfg.max_model_len == 64 * 16  # capped by what the pool can hold
        reqs = [make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        got = run_all(engine, reqs)
        outs[shapes] = [got[r.request_id] for r in reqs]
        runner = engine.target
        if shapes == "bucketed":
            assert isinstance(runner, BucketedRunner)
            assert runner.bucketed_steps > 0 and runner.ragged_steps > 0  # prompts: ragged
            assert runner.buffers.max_blocks == 64  # block tables as wide as the pool, no more
        else:
            assert not isinstance(runner, BucketedRunner)
    assert outs["bucketed"] == outs["ragged"]
    assert sum(r.stats.num_draft_tokens for r in reqs) > 0
