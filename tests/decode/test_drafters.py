"""Every drafter, in both modes: greedy output is the target's, seeded sampling does not depend on
the speculation length, and decode never recomputes a prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.drafters.lookup_first import LookupFirstDrafter
from decode.drafters.ngram import NgramDrafter
from decode.engine import DecodeEngine
from models.config import LlamaConfig
from models.eagle import save_random_eagle, save_random_eagle3
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from tests.decode.engine_utils import make_request, run_all


@pytest.fixture(scope="module")
def eagle_folder(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised EAGLE head for the tiny target, in the published layout."""
    return save_random_eagle(tiny_folder, tmp_path_factory.mktemp("eagle"))


@pytest.fixture(scope="module")
def eagle3_folder(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random EAGLE-3 head (the target's three streams, a reduced vocabulary) for the tiny
    target, in the published layout."""
    return save_random_eagle3(
        tiny_folder, tmp_path_factory.mktemp("eagle3"), draft_vocab_size=8192, aux_layers=(0, 1, 1)
    )


def _spec(
    kind: str, tiny_draft_folder: Path, eagle_folder: Path, k: int, adaptive: bool
) -> DraftSpec:
    """``kind``: a ``DraftKind`` value (or ``eagle3``: the head in ``eagle_folder`` is one),
    ``+lookup`` for n-gram lookup first, ``-tree`` for draft trees 3 wide (greedy requests)."""
    tree = kind.endswith("-tree")
    kind = kind.removesuffix("-tree")
    base, lookup = kind.removesuffix("+lookup"), kind.endswith("+lookup")
    model = {
        "ngram": None,
        "draft_model": ModelSpec(str(tiny_draft_folder)),
        "eagle": ModelSpec(str(eagle_folder)),
        "eagle3": ModelSpec(str(eagle_folder)),
    }
    return DraftSpec(
        DraftKind.EAGLE if base == "eagle3" else DraftKind(base),
        model=model[base],
        num_speculative_tokens=k,
        adaptive=adaptive,
        lookup_first=lookup,
        tree_width=3 if tree else 1,
    )


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(41)
    base = [torch.randint(3, 49152, (18 + 7 * i,), generator=g).tolist() for i in range(3)]
    base[0] = base[0][:6] * 4  # repetitive, so n-gram lookup has something to propose
    return base


def _run(
    target: ModelSpec, draft: DraftSpec, sp: list[SamplingParams], disaggregated: bool
) -> tuple[list[list[int]], DecodeEngine, list]:
    engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=128))
    prefill = (
        PrefillWorker(PrefillWorkerConfig("t", target, draft, num_blocks=64))
        if disaggregated
        else None
    )
    reqs = [make_request(p, s) for p, s in zip(_prompts(), sp, strict=True)]
    out = run_all(engine, reqs, prefill=prefill)
    return [out[r.request_id] for r in reqs], engine, reqs


@pytest.mark.parametrize(
    "kind",
    [
        "ngram",
        "draft_model",
        "eagle",
        "eagle+lookup",
        "eagle-tree",
        "eagle+lookup-tree",
        "eagle3",
        "eagle3+lookup-tree",
    ],
)
@pytest.mark.parametrize("disaggregated", [False, True])
def test_greedy_is_the_targets_and_no_prompt_is_recomputed(
    tiny_folder: Path,
    tiny_draft_folder: Path,
    eagle_folder: Path,
    eagle3_folder: Path,
    kind: str,
    disaggregated: bool,
) -> None:
    if kind.startswith("eagle3"):
        eagle_folder = eagle3_folder
    target = ModelSpec(str(tiny_folder))
    greedy = [SamplingParams(temperature=0.0, max_tokens=20)] * 3
    want, _, _ = _run(target, DraftSpec(), greedy, disaggregated=False)
    # k is pinned: the checks below need every drafter asked, and adaptive speculation may
    # rightly grant a random head no drafts at all (whether it does depends on the step and
    # draft-round times this machine measures; tests/speculation covers that choice).
    got, engine, reqs = _run(
        target, _spec(kind, tiny_draft_folder, eagle_folder, 3, False), greedy, disaggregated
    )
    assert got == want
    drafted = sum(r.stats.num_draft_tokens for r in reqs)
    assert drafted > 0
    lookup = engine.drafter.lookup if isinstance(engine.drafter, LookupFirstDrafter) else None
    lookup = engine.drafter if isinstance(engine.drafter, NgramDrafter) else lookup
    if lookup is not None:  # every finished request's n-gram index is dropped
        assert lookup._indexes == {}
    if isinstance(engine.drafter, LookupFirstDrafter):
        # the repetitive prompt is looked up, the random ones are left to the head
        share = engine.drafter.lookup_share
        assert share is not None and 0 < share < 1
        assert engine.stats().draft_tokens_fed > 0
    if disaggregated:
        # a verified draft level puts one token in the target's step (a chain), or up to the
        # tree's width of them; a recomputed prompt would add its whole length
        width = 3 if kind.endswith("-tree") else 1
        decoded = sum(len(o) for o in got) - len(got)
        assert engine.stats().target_tokens_fed <= decoded + width * drafted
        if kind != "ngram":  # the draft was fed outputs and its own guesses, never a prompt
            assert engine.stats().draft_tokens_fed <= decoded + width * drafted


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_seeded_sampling_does_not_depend_on_the_speculation_length(
    tiny_folder: Path, tiny_draft_folder: Path, eagle_folder: Path, kind: str
) -> None:
    target = ModelSpec(str(tiny_folder))
    sampled = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=s, seeded=True)
        for s in (1, 2, 3)
    ]
    outs = [
        _run(
            target,
            _spec(kind, tiny_draft_folder, eagle_folder, k, adaptive),
            sampled,
            disaggregated=d,
        )[0]
        for k, adaptive, d in ((1, False, False), (4, False, True), (6, True, False))
    ]
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.parametrize(
    ("adaptive", "head"), [(False, "eagle"), (True, "eagle"), (True, "eagle3")]
)
def test_seeded_eagle_sampling_does_not_depend_on_the_batch(
    tiny_folder: Path,
    tiny_draft_folder: Path,
    eagle_folder: Path,
    eagle3_folder: Path,
    adaptive: bool,
    head: str,
) -> None:
    """An EAGLE head's later drafts read its own predicted features, so its proposal at a
    position depends on where the step began: a client-seeded sampled request is held at its
    full speculation length every step (``SpeculationPolicy.held``), so neither the batch
    around it nor adaptive speculation changes its tokens."""
    target = ModelSpec(str(tiny_folder))
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=9, seeded=True)
    if head == "eagle3":
        eagle_folder = eagle3_folder
    pinned_spec = _spec("eagle", tiny_draft_folder, eagle_folder, 3, False)
    pinned = DecodeEngine(DecodeEngineConfig("t", target, pinned_spec, num_blocks=128))
    alone = make_request(_prompts()[2], sp)
    want = run_all(pinned, [alone])[alone.request_id]
    spec = _spec("eagle", tiny_draft_folder, eagle_folder, 3, adaptive)
    engine = DecodeEngine(DecodeEngineConfig("t", target, spec, num_blocks=128))
    crowd = [
        make_request(p, SamplingParams(temperature=0.8, max_tokens=30, seed=i))
        for i, p in enumerate(_prompts())
    ]
    again = make_request(_prompts()[2], sp)
    got = run_all(engine, [*crowd, again])
    assert got[again.request_id] == want
    assert again.stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle+lookup"])
def test_trees_and_chains_share_a_batch(
    tiny_folder: Path, tiny_draft_folder: Path, eagle_folder: Path, kind: str
) -> None:
    """Greedy requests draft trees while seeded sampled ones beside them draft chains: both
    give what they give with chains only (greedy: the target's output)."""
    target = ModelSpec(str(tiny_folder))
    sp = [
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=5, seeded=True),
        SamplingParams(temperature=0.0, max_tokens=16),
    ]
    want, _, _ = _run(target, _spec(kind, tiny_draft_folder, eagle_folder, 3, False), sp, False)
    tree_spec = _spec(f"{kind}-tree", tiny_draft_folder, eagle_folder, 3, False)
    got, _, reqs = _run(target, tree_spec, sp, disaggregated=True)
    assert got == want
    assert all(r.stats.num_draft_tokens > 0 for r in reqs)


@pytest.mark.parametrize("head", ["eagle", "eagle3"])
def test_eagle_handoff_carries_the_last_feature(
    tiny_folder: Path, eagle_folder: Path, eagle3_folder: Path, tiny_draft_folder: Path, head: str
) -> None:
    """The handoff carries the head's input at the last prompt position: the final hidden
    state (EAGLE-1/2), or the three residual streams (EAGLE-3)."""
    target = ModelSpec(str(tiny_folder))
    folder = eagle3_folder if head == "eagle3" else eagle_folder
    spec = _spec("eagle", tiny_draft_folder, folder, 3, True)
    prefill = PrefillWorker(
        PrefillWorkerConfig("t", target, spec, num_blocks=64, max_num_batched_tokens=8)
    )
    prompt = _prompts()[1]
    h = prefill.prefill(make_request(prompt, SamplingParams(temperature=0.0, max_tokens=4)))
    width = LlamaConfig.from_folder(tiny_folder).hidden_size * (3 if head == "eagle3" else 1)
    assert h.hidden_state is not None and h.hidden_state.shape == (width,)
    assert h.draft_computed == len(prompt) - 1  # every head position but the last one
    assert h.acceptance_probe is not None and 0.0 <= h.acceptance_probe <= 1.0


def test_lookup_first_probe_scores_lookup_where_it_matches(
    tiny_folder: Path, eagle_folder: Path, tiny_draft_folder: Path
) -> None:
    """On a prompt that repeats itself lookup matches at every probed position, so with
    ``lookup_first`` the probe is n-gram's, not the head's."""
    target = ModelSpec(str(tiny_folder))
    prompt = _prompts()[0]  # six tokens, four times
    probes = {}
    for kind in ("ngram", "eagle", "eagle+lookup"):
        spec = _spec(kind, tiny_draft_folder, eagle_folder, 3, True)
        prefill = PrefillWorker(PrefillWorkerConfig("t", target, spec, num_blocks=64))
        sp = SamplingParams(temperature=1.0, max_tokens=4, seed=1)  # random models: p, q ~flat
        probes[kind] = prefill.prefill(make_request(prompt, sp)).acceptance_probe
    assert probes["eagle+lookup"] == pytest.approx(probes["ngram"], abs=1e-6)
    assert probes["eagle+lookup"] != pytest.approx(probes["eagle"], abs=1e-3)


def test_seeded_lookup_first_sampling_does_not_depend_on_the_batch(
    small_vocab: tuple[ModelSpec, ModelSpec],
) -> None:
    """Lookup first proposes by lookup where the step's first position matches and by the model
    otherwise, so a position's proposal depends on where the step began; a client-seeded
    sampled request is held at its cap, and its tokens alone (pinned k) equal its tokens in a
    crowd (adaptive k), while lookup switches on and off during its output."""
    target, draft = small_vocab
    spec = DraftSpec(
        DraftKind.DRAFT_MODEL,
        model=draft,
        num_speculative_tokens=3,
        adaptive=False,
        lookup_first=True,
    )
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 64, (12 + 5 * i,), generator=g).tolist() for i in range(4)]
    sp = SamplingParams(temperature=1.0, max_tokens=40, seed=11, seeded=True)
    pinned = DecodeEngine(DecodeEngineConfig("t", target, spec, num_blocks=128))
    alone = make_request(prompts[0], sp)
    want = run_all(pinned, [alone])[alone.request_id]
    assert isinstance(pinned.drafter, LookupFirstDrafter)
    share = pinned.drafter.lookup_share
    assert share is not None and 0.2 < share < 0.8  # lookup switched on and off
    adaptive = dataclasses.replace(spec, adaptive=True)
    engine = DecodeEngine(DecodeEngineConfig("t", target, adaptive, num_blocks=128))
    crowd = [
        make_request(p, SamplingParams(temperature=0.8, max_tokens=30 + 3 * i, seed=i))
        for i, p in enumerate(prompts[1:])
    ]
    again = make_request(prompts[0], sp)
    got = run_all(engine, [*crowd, again])
    assert got[again.request_id] == want
    assert again.stats.num_draft_tokens > 0


def test_eagle_chains_drafted_on_the_device_propose_what_host_rounds_do(
    tiny_folder: Path, eagle_folder: Path
) -> None:
    """Rounds fed on the device and read once propose the tokens rounds read one at a time
    do (forced here by a confidence cutoff no chain falls under): the same drafts accepted,
    request by request, greedy and sampled."""
    draft = _spec("eagle", tiny_folder, eagle_folder, 4, adaptive=False)
    sp = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.8, max_tokens=24, seed=3, seeded=True),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    got = {}
    for path in ("device", "host"):
        engine = DecodeEngine(DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), draft))
        assert engine.drafter is not None
        if path == "host":
            engine.drafter.stop_chains_below(1e-300)
        reqs = [make_request(p, s) for p, s in zip(_prompts(), sp, strict=True)]
        out = run_all(engine, reqs)
        stats = [(r.stats.num_draft_tokens, r.stats.num_accepted_tokens) for r in reqs]
        got[path] = ([out[r.request_id] for r in reqs], stats)
        assert engine.drafter.positions_stopped == 0
    assert got["device"] == got["host"]
    assert sum(a for _, a in got["device"][1]) > 0  # drafts were accepted: their tokens matter


def test_draft_model_rounds_fed_on_the_device_propose_what_host_rounds_do(
    tiny_folder: Path, tiny_draft_folder: Path, eagle_folder: Path
) -> None:
    """A draft model's rounds fed on the device and read once propose what rounds read one at
    a time do (the host path forced by a processor that changes nothing: a zero logit bias)."""
    draft = _spec("draft_model", tiny_draft_folder, eagle_folder, 4, adaptive=False)
    base = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.8, max_tokens=24, seed=3, seeded=True),
        SamplingParams(temperature=0.0, max_tokens=24),
    ]
    got = {}
    for path in ("device", "host"):
        sp = (
            base
            if path == "device"
            else [dataclasses.replace(s, logit_bias=((5, 0.0),)) for s in base]
        )
        assert all(s.processes for s in sp) == (path == "host")
        engine = DecodeEngine(DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), draft))
        reqs = [make_request(p, s) for p, s in zip(_prompts(), sp, strict=True)]
        out = run_all(engine, reqs)
        stats = [(r.stats.num_draft_tokens, r.stats.num_accepted_tokens) for r in reqs]
        got[path] = ([out[r.request_id] for r in reqs], stats)
    assert got["device"] == got["host"]
    assert sum(a for _, a in got["device"][1]) > 0  # drafts were accepted: their tokens matter


_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


@pytest.mark.parametrize("kind", ["eagle", "draft_model", "ngram", "eagle+lookup", "eagle-tree"])
def test_a_drafted_step_reads_from_the_device_once(
    tiny_folder: Path,
    tiny_draft_folder: Path,
    eagle_folder: Path,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Drafting and verification together read tensors on the host once a step (the drafts
    travel with the verdicts), greedy and sampled chains in one batch: every tensor method
    that hands the host a value is counted, where a GPU would wait. Greedy requests' trees
    (k = 3: three levels) add a read a level, every tree's at once."""
    reads: list[str] = []
    armed = [False]
    for name in _READS:
        method = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _m: Any = method, _n: str = name) -> Any:
            if armed[0]:
                reads.append(_n)
            return _m(self, *a)

        monkeypatch.setattr(torch.Tensor, name, counted)
    spec = _spec(kind, tiny_draft_folder, eagle_folder, 3, False)
    engine = DecodeEngine(DecodeEngineConfig("t", ModelSpec(str(tiny_folder)), spec))
    sp = [
        SamplingParams(temperature=0.8 if i == 1 else 0.0, max_tokens=40, seed=i, seeded=True)
        for i in range(3)
    ]
    reqs = [make_request(p, s) for p, s in zip(_prompts(), sp, strict=True)]
    for r in reqs:
        engine.add(r, None)
    while any(not r.output_token_ids for r in reqs):  # prompts and first tokens
        engine.step()
    per_step = []
    for _ in range(4):
        reads.clear()
        armed[0] = True
        engine.step()
        armed[0] = False
        per_step.append(len(reads))
    drafted = sum(r.stats.num_draft_tokens for r in reqs)
    engine.close()
    assert drafted > 0
    assert per_step == [1 + (3 if kind.endswith("-tree") else 0)] * 4, reads
