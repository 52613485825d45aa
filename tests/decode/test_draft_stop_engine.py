"""Per-position draft stopping in the engine: an EAGLE head's chains end where their tokens'
product of head probabilities falls under the cutoff, and the outputs stay the target's:
greedy outputs identical to plain decoding, sampled tokens at positions 1 and 2 distributed as
plain sampling's (two-sample chi-square)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.eagle import save_random_eagle
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from speculation.draft_stop import DraftStop
from tests.decode.engine_utils import make_request, run_all
from tests.decode.test_exactness import _same_distribution

PROMPT = [5, 9, 14, 3, 22, 7, 31, 42]


class _Pinned(DraftStop):
    """A cutoff that stays put, so chains stop whatever the load."""

    def update(self, tokens_per_s: float, marginal_s_per_token: float) -> float:
        return self.cutoff


@pytest.fixture(scope="module")
def engines(
    small_vocab: tuple[ModelSpec, ModelSpec], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, DecodeEngine]]:
    target, _ = small_vocab
    head = save_random_eagle(Path(target.folder), tmp_path_factory.mktemp("eagle-stop"))
    # k pinned at 3, so every request drafts chains that can stop, whatever this machine's
    # step times would make the goodput policy grant; the stopping rule is the engine's own
    spec = DraftSpec(
        DraftKind.EAGLE, model=ModelSpec(str(head)), num_speculative_tokens=3, adaptive=False
    )
    kw = {"num_blocks": 1024, "max_batch_size": 256}
    stopping = DecodeEngine(DecodeEngineConfig("t", target, spec, **kw))  # type: ignore[arg-type]
    pinned = _Pinned()
    pinned.cutoff = 0.05  # a random head's tokens: some chains stop after one, some after two
    stopping.draft_stop = pinned
    plain = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), **kw))  # type: ignore[arg-type]
    yield {"stopping": stopping, "plain": plain}
    stopping.close()
    plain.close()


def test_stopped_chains_keep_greedy_outputs(engines: dict[str, DecodeEngine]) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = [[p + i for p in PROMPT] for i in range(6)]
    outs = {}
    for name, engine in engines.items():
        reqs = [make_request(p, sp) for p in prompts]
        got = run_all(engine, reqs)
        outs[name] = [got[r.request_id] for r in reqs]
    assert outs["stopping"] == outs["plain"]
    assert engines["stopping"].drafter is not None
    assert engines["stopping"].drafter.positions_stopped > 0


@pytest.mark.slow
def test_stopped_chains_sample_the_targets_distribution(engines: dict[str, DecodeEngine]) -> None:
    def tokens(engine: DecodeEngine) -> torch.Tensor:
        reqs = [
            make_request(PROMPT, SamplingParams(temperature=1.0, max_tokens=3, seed=s))
            for s in range(2000)
        ]
        out = run_all(engine, reqs)
        return torch.tensor([out[r.request_id] for r in reqs])  # [n, 3]

    drafter = engines["stopping"].drafter
    assert drafter is not None
    before = drafter.positions_stopped
    a, b = tokens(engines["stopping"]), tokens(engines["plain"])
    assert drafter.positions_stopped > before
    for position in (1, 2):
        assert _same_distribution(a[:, position], b[:, position]) > 0.01


def test_early_stop_is_refused_where_no_head_prices_it() -> None:
    with pytest.raises(ValueError, match="early_stop"):
        DraftSpec(DraftKind.NGRAM, early_stop=True)
