"""A request's ``n`` choices on the decode engine: one prompt (one prefill, one KV pull) shared by
every choice, each choice the sequence a lone request with its seed would give, nothing leaked.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from kvtransfer.handoff import KVHandoff
from models.eagle import save_random_eagle
from models.request import Request, choice_id
from models.sampling import SamplingParams, choice_seed
from models.spec import DraftKind, DraftSpec, ModelSpec
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from tests.decode.engine_utils import make_request, run_all

N = 3
PROMPT_LEN = 37  # two whole blocks of 16 are shared, each choice computes the last 5 tokens
SHARED = 32


@pytest.fixture(scope="module")
def eagle_folder(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_eagle(tiny_folder, tmp_path_factory.mktemp("eagle"))


def _prompt() -> list[int]:
    g = torch.Generator().manual_seed(5)
    head = torch.randint(3, 49152, (12,), generator=g).tolist()
    return (head * 4)[:PROMPT_LEN]  # repetitive: n-gram lookup proposes


def _draft(kind: str, tiny_draft_folder: Path, eagle_folder: Path) -> DraftSpec:
    return {
        "none": DraftSpec(),
        "ngram": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=3),
        "draft_model": DraftSpec(
            DraftKind.DRAFT_MODEL, ModelSpec(str(tiny_draft_folder)), num_speculative_tokens=3
        ),
        "eagle+lookup": DraftSpec(
            DraftKind.EAGLE,
            ModelSpec(str(eagle_folder)),
            num_speculative_tokens=3,
            lookup_first=True,
        ),
    }[kind]


def _run_choices(
    engine: DecodeEngine, req: Request, prefill: PrefillWorker | None
) -> dict[int, list[int]]:
    """Every choice's output tokens (prefill's first token first, for choice 0)."""
    out: dict[int, list[int]] = {i: [] for i in range(req.sampling.n)}
    index = {choice_id(req.request_id, i): i for i in range(req.sampling.n)}
    handoff: KVHandoff | None = None
    if prefill is not None:
        handoff = prefill.prefill(req)
        out[0].append(handoff.first_token)
    engine.add(req, handoff)
    done: set[int] = set()
    deadline = time.monotonic() + 120
    while len(done) < req.sampling.n and time.monotonic() < deadline:
        for o in engine.step():
            assert o.error is None, o.error
            out[index[o.request_id]].extend(o.new_token_ids)
            if o.finished:
                done.add(index[o.request_id])
    assert len(done) == req.sampling.n, "not every choice finished"
    while engine.has_work and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.001)  # the pace of a loop that waits on has_work, not synchronisation
    if prefill is not None:
        prefill.reap()
    return out


@pytest.mark.parametrize("kind", ["none", "ngram", "draft_model", "eagle+lookup"])
@pytest.mark.parametrize("disaggregated", [False, True])
def test_each_choice_is_the_lone_request_of_its_seed_and_the_prompt_is_computed_once(
    tiny_folder: Path, tiny_draft_folder: Path, eagle_folder: Path, kind: str, disaggregated: bool
) -> None:
    target = ModelSpec(str(tiny_folder))
    draft = _draft(kind, tiny_draft_folder, eagle_folder)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=77, seeded=True, n=N)
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64))
    prefill = (
        PrefillWorker(PrefillWorkerConfig("t", target, draft, num_blocks=32))
        if disaggregated
        else None
    )
    got = _run_choices(engine, make_request(_prompt(), sp), prefill)

    lone = [
        make_request(_prompt(), replace(sp, n=1, seed=choice_seed(sp.seed, i))) for i in range(N)
    ]
    ref_engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64))
    want = run_all(ref_engine, lone)
    assert [got[i] for i in range(N)] == [want[r.request_id] for r in lone]
    assert len({tuple(v) for v in got.values()}) == N  # independent samples, not copies

    # The prompt was computed once (on prefill, or by choice 0); each further choice computed
    # only the prompt's last partial block (and, without drafts, exactly its outputs after).
    fed = engine.stats().target_tokens_fed
    tails = (N - 1) * (PROMPT_LEN - SHARED)
    own = 0 if disaggregated else PROMPT_LEN
    decoded = sum(len(v) - 1 for v in got.values())
    drafted = sum(r.stats.num_draft_tokens for r in lone)
    if kind == "none":
        assert fed == own + tails + decoded
    else:
        assert own + tails + decoded <= fed <= own + tails + decoded + 2 * drafted + 4 * N
    if disaggregated:
        assert engine.transport.counters.pulls_done == 1  # one pull for all the choices
    engine.allocator.check()
    assert engine.allocator.num_free == engine.cfg.num_blocks


def test_greedy_choices_are_the_greedy_output(tiny_folder: Path, eagle_folder: Path) -> None:
    target = ModelSpec(str(tiny_folder))
    draft = _draft("eagle+lookup", tiny_folder, eagle_folder)
    sp = SamplingParams(temperature=0.0, max_tokens=16, n=N)
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64))
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, draft, num_blocks=32))
    got = _run_choices(engine, make_request(_prompt(), sp), prefill)
    plain = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64))
    lone = make_request(_prompt(), replace(sp, n=1))
    want = run_all(plain, [lone])[lone.request_id]
    assert all(got[i] == want for i in range(N))


def test_choice_zero_ended_on_prefill_still_lends_its_prompt(tiny_folder: Path) -> None:
    """max_tokens 1: prefill's first token ends choice 0, yet its KV is pulled once and the
    other choices start on it; choice 0 ends with no new token."""
    target = ModelSpec(str(tiny_folder))
    sp = SamplingParams(temperature=1.0, max_tokens=1, seed=3, seeded=True, n=N)
    engine = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64))
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, DraftSpec(), num_blocks=32))
    got = _run_choices(engine, make_request(_prompt(), sp), prefill)
    assert all(len(got[i]) == 1 for i in range(N))
    assert engine.transport.counters.pulls_done == 1
    assert engine.stats().target_tokens_fed == (N - 1) * (PROMPT_LEN - SHARED)
    assert engine.allocator.num_free == engine.cfg.num_blocks


def test_aborting_the_request_ends_every_choice_and_frees_every_block(tiny_folder: Path) -> None:
    target = ModelSpec(str(tiny_folder))
    sp = SamplingParams(temperature=1.0, max_tokens=200, seed=4, seeded=True, n=N)
    engine = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64))
    req = make_request(_prompt(), sp)
    engine.add(req, None)
    for _ in range(4):  # the prompt, then the choices start and decode
        engine.step()
    assert len(engine.running) == N
    shared = req.block_table[0]
    assert engine.allocator.ref_count(shared) == N  # one block, three owners
    for i in range(N):  # as the decode server does when the client goes away
        engine.abort(choice_id(req.request_id, i))
    assert not engine.running and not engine.has_work
    engine.allocator.check()
    assert engine.allocator.num_free == engine.cfg.num_blocks


def test_aborted_before_its_prompt_is_computed_nothing_starts(tiny_folder: Path) -> None:
    target = ModelSpec(str(tiny_folder))
    sp = SamplingParams(temperature=1.0, max_tokens=20, seed=4, seeded=True, n=N)
    cfg = DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64, max_num_batched_tokens=16)
    engine = DecodeEngine(cfg)
    req = make_request(_prompt(), sp)
    engine.add(req, None)
    engine.step()  # the first 16-token chunk of the prompt
    assert list(engine.running) == [req.request_id]
    engine.abort(req.request_id)
    for _ in range(3):
        assert engine.step() == []
    assert not engine.running
    assert engine.allocator.num_free == engine.cfg.num_blocks
