"""The start-up warm-up: its grid is every bucket a step can land in, each warm batch lands in
its own bucket, and after it traffic compiles nothing (flex_attention compiled on this CPU,
which is what a GPU also compiles; CUDA graph captures are counted the same way)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.attention.flex import FlexBackend
from models.attention.flex_kernel import FlexKernel
from models.backend import TorchBackend
from models.kv_layout import kv_pool_shape
from models.spec import ModelSpec
from runtime.backends import model_attention_spec
from runtime.bucketed import BucketedRunner
from runtime.runner import SeqInput
from runtime.step_buffers import StepBuffers
from runtime.warm_up import warm_batch, warm_up

BS = 16


def test_the_grid_holds_every_bucket_a_step_lands_in_and_nothing_else() -> None:
    bufs = StepBuffers(6, 8, 5, 4, torch.device("cpu"))
    grid = bufs.grid()
    # seqs {1, 2, 4, 6} x query {1, 2, 4, 8} x blocks {1, 2, 4, 5}, less what no step reaches:
    # 5..8 new tokens and a cached one need 2 blocks of 4 or more
    assert len(grid) == 4 * (4 * 4 - 1)
    assert len(set(grid)) == len(grid)
    for bucket in grid:  # each warm batch is a bucketed step of its own bucket
        batch = warm_batch(bucket, 4)
        assert bufs.fits(batch)
        assert bufs.fill(batch).bucket == bucket
    rng = random.Random(0)
    reached = set()
    for _ in range(3000):  # and any step that fits lands in the grid
        batch = []
        most_new = rng.randint(1, 8)
        most_tokens = rng.randint(most_new + 1, 20)
        for _ in range(rng.randint(1, 6)):
            q = rng.randint(1, most_new)
            cached = rng.randint(1, most_tokens - q)
            blocks = -(-(cached + q) // 4)
            batch.append(SeqInput(list(range(blocks)), cached, [1] * q, [0]))
        if bufs.fits(batch):
            reached.add(bufs.fill(batch).bucket)
    assert reached == set(grid)


@pytest.mark.slow  # flex_attention compiles its kernels on this CPU
def test_after_the_warm_up_traffic_compiles_nothing(tiny_folder: Path) -> None:
    model = ModelSpec(str(tiny_folder)).load("cpu")
    c = model.cfg
    g = torch.Generator().manual_seed(2)
    traffic = []
    for widths, cached in (([1, 1], [20, 5]), ([2], [30]), ([1, 2], [3, 17]), ([2, 2], [9, 1])):
        traffic.append(
            [
                SeqInput([1, 0], n, torch.randint(3, 40000, (w,), generator=g).tolist(), [w - 1])
                for w, n in zip(widths, cached, strict=True)
            ]
        )
    compiled = {}
    for warmed in (False, True):
        torch._dynamo.reset()  # compiled kernels are cached per function, across instances
        pool = torch.zeros(kv_pool_shape(8, c.num_kv_heads, c.num_layers, BS, c.head_dim))
        # the GPU's backend, here: these contexts are short, so read them in place too
        flex = FlexBackend(model_attention_spec(model, pool, BS), FlexKernel(min_context_tokens=0))
        runner = BucketedRunner(model, pool, BS, 2, 2, 2, backend=TorchBackend(model, flex))
        if warmed:
            done = warm_up(runner, runner)
            assert done.buckets == len(runner.buffers.grid()) == 8
            assert done.compiles > 0 and done.captures == 0  # no CUDA graphs on a CPU
        runner.serving()
        for batch in traffic:
            runner.run(batch)
        assert runner.bucketed_steps == len(traffic) + (8 if warmed else 0)
        compiled[warmed], captured = runner.during_traffic()
        assert captured == 0
        described = runner.describe()
        assert described["compiles_during_traffic"] == compiled[warmed]
        assert flex.fallbacks == 0
    assert compiled[True] == 0
    assert compiled[False] > 0  # the same traffic unwarmed compiles as it goes


def test_an_engine_warms_up_before_serving_and_decodes_as_one_that_did_not(
    tiny_folder: Path,
) -> None:
    """The warm-up writes the empty pool: greedy outputs with it equal those without."""
    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.sampling import SamplingParams
    from models.spec import DraftKind, DraftSpec
    from tests.decode.engine_utils import make_request, run_all

    g = torch.Generator().manual_seed(4)
    head = torch.randint(3, 40000, (7,), generator=g).tolist()
    prompts = [head * 3, torch.randint(3, 40000, (20,), generator=g).tolist()]
    spec = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=3)
    cfg = DecodeEngineConfig(
        "t", ModelSpec(str(tiny_folder)), spec, num_blocks=16, max_batch_size=4
    )
    outs = {}
    for warm in ("off", "on"):
        engine = DecodeEngine(replace(cfg, step_shapes="bucketed", warm_up=warm))
        if warm == "on":
            assert engine.warmed is not None
            # seqs {1, 2, 4} x query {1, 2, 4} x blocks {1, 2, 4, 8, 16}
            assert engine.warmed.buckets == 3 * 3 * 5
        else:
            assert engine.warmed is None
        reqs = [make_request(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in prompts]
        got = run_all(engine, reqs)
        outs[warm] = [got[r.request_id] for r in reqs]
        assert engine.bucketed is not None and engine.bucketed.bucketed_steps > 0
    assert outs["on"] == outs["off"]


@pytest.mark.parametrize("kind", ["draft_model", "eagle", "eagle3"])
def test_a_drafters_rounds_step_in_buckets_warmed_with_the_targets(
    tiny_folder: Path, tiny_draft_folder: Path, tmp_path: Path, kind: str
) -> None:
    """A draft model's or EAGLE head's chain rounds run at the target's buckets (their tokens
    put there from the device; a head's catch-up and rounds each with their own features),
    warmed at start-up beside the target's: the same tokens as ragged steps."""
    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.eagle import save_random_eagle, save_random_eagle3
    from models.sampling import SamplingParams
    from models.spec import DraftKind, DraftSpec
    from tests.decode.engine_utils import make_request, run_all

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (9, 20, 14)]
    if kind == "draft_model":
        draft = ModelSpec(str(tiny_draft_folder))
    elif kind == "eagle":
        draft = ModelSpec(str(save_random_eagle(tiny_folder, tmp_path / "e")))
    else:
        folder = save_random_eagle3(tiny_folder, tmp_path / "e3", aux_layers=(0, 1, 1))
        draft = ModelSpec(str(folder))
    spec = DraftSpec(
        DraftKind.EAGLE if kind.startswith("eagle") else DraftKind.DRAFT_MODEL,
        model=draft,
        num_speculative_tokens=3,
        adaptive=False,
    )
    cfg = DecodeEngineConfig(
        "t", ModelSpec(str(tiny_folder)), spec, num_blocks=16, max_batch_size=4
    )
    sp = [
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=0.8, max_tokens=16, seed=3, seeded=True),
        SamplingParams(temperature=0.0, max_tokens=16),
    ]
    outs = {}
    for shapes in ("ragged", "bucketed"):
        engine = DecodeEngine(replace(cfg, step_shapes=shapes, warm_up="on"))
        reqs = [make_request(p, s) for p, s in zip(prompts, sp, strict=True)]
        got = run_all(engine, reqs)
        outs[shapes] = [got[r.request_id] for r in reqs]
        if shapes == "bucketed":
            rounds = engine.draft_bucketed
            assert rounds is not None and engine.bucketed is not None and engine.warmed
            grid = len(rounds.buffers.grid())
            assert engine.warmed.buckets == grid + len(engine.bucketed.buffers.grid())
            warm = grid * (2 if kind.startswith("eagle") else 1)  # a head: both feature sources
            # every round of traffic but the prompts' first catch-up (nothing cached yet)
            assert rounds.bucketed_steps > warm and rounds.ragged_steps == 1
            assert engine.during_traffic() == (0, 0)
        else:
            assert engine.draft_bucketed is None
        assert sum(r.stats.num_accepted_tokens for r in reqs) > 0
        engine.close()
    assert outs["bucketed"] == outs["ragged"]
