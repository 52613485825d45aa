"""Logits processors stay exact under speculation, for every drafter: the tokens at positions
1-3 (where drafts are verified, and where penalties, min_tokens and the grammar see the drafts
before each position) have the same distribution with speculation as without (two-sample
chi-square at 1%, fixed seeds), and each processor really moves that distribution (else the
test could not tell a processor that ignores the drafts from a correct one)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.eagle import save_random_eagle
from models.grammar import GrammarSpec
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from tests.decode.engine_utils import make_request, run_all
from tests.decode.test_exactness import _same_distribution

SAMPLES = 4000
TOKENS = 4
PROMPT = [40, 41, 28, 40, 41, 28, 40, 41, 28, 40]  # repeats: n-gram lookup proposes
# sharp enough that penalties, which act before the temperature, move it visibly
BASE = SamplingParams(temperature=0.4, max_tokens=TOKENS, stop_token_ids=())

PROCESSORS = {
    "penalties": replace(BASE, presence_penalty=1.5, frequency_penalty=1.0),
    "repetition": replace(BASE, repetition_penalty=2.5),
    "logit_bias": replace(BASE, logit_bias=((40, 3.0), (41, 2.5), (28, -100.0), (33, 4.0))),
    "min_p": replace(BASE, min_p=0.2),
    # 5 of the likeliest ids stop the sequence, but not before two tokens are out
    "min_tokens": replace(BASE, min_tokens=2, stop_token_ids=(40, 41, 28, 33, 34)),
    "grammar": replace(BASE, grammar=GrammarSpec("regex", "[0-9]{1,2}(,[0-9]{1,2})*")),
}


def _run(engine: DecodeEngine, sp: SamplingParams) -> tuple[torch.Tensor, int]:
    """[SAMPLES, TOKENS] token ids + 1 (0: the sequence had stopped), and drafts verified."""
    reqs = [make_request(PROMPT, replace(sp, seed=s)) for s in range(SAMPLES)]
    out = run_all(engine, reqs)
    pad = [out[r.request_id] + [-1] * (TOKENS - len(out[r.request_id])) for r in reqs]
    return torch.tensor(pad) + 1, sum(r.stats.num_draft_tokens for r in reqs)


def _tokens(engine: DecodeEngine, sp: SamplingParams) -> torch.Tensor:
    return _run(engine, sp)[0]


@pytest.fixture(scope="module")
def engines(
    small_vocab: tuple[ModelSpec, ModelSpec], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, DecodeEngine]:
    target, draft = small_vocab
    head = save_random_eagle(Path(target.folder), tmp_path_factory.mktemp("eagle64"))
    specs = {
        "none": DraftSpec(),
        "draft_model": DraftSpec(DraftKind.DRAFT_MODEL, model=draft),
        "ngram": DraftSpec(DraftKind.NGRAM),
        "eagle": DraftSpec(DraftKind.EAGLE, model=ModelSpec(str(head))),
    }
    kw = {"num_blocks": 1024, "max_batch_size": 256}
    built = {
        name: DecodeEngine(
            DecodeEngineConfig(
                "t",
                target,
                replace(s, num_speculative_tokens=3, adaptive=False),
                **kw,  # type: ignore[arg-type]
            )
        )
        for name, s in specs.items()
    }
    yield built
    for e in built.values():
        e.close()


@pytest.fixture(scope="module")
def plain(engines: dict[str, DecodeEngine]) -> dict[str, torch.Tensor]:
    """Each processor's tokens without speculation, and the unprocessed ones."""
    out = {name: _tokens(engines["none"], sp) for name, sp in PROCESSORS.items()}
    out["unprocessed"] = _tokens(engines["none"], BASE)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["draft_model", "ngram", "eagle"])
@pytest.mark.parametrize("processor", list(PROCESSORS))
def test_processor_is_exact_under_speculation(
    engines: dict[str, DecodeEngine], plain: dict[str, torch.Tensor], drafter: str, processor: str
) -> None:
    got, drafted = _run(engines[drafter], PROCESSORS[processor])
    assert drafted > SAMPLES // 10  # speculation really ran
    want = plain[processor]
    for position in range(1, TOKENS):
        assert _same_distribution(got[:, position], want[:, position]) > 0.01, position
    moved = [
        _same_distribution(want[:, position], plain["unprocessed"][:, position])
        for position in range(1, TOKENS)
    ]
    assert min(moved) < 0.01  # the processor changes what is sampled


@pytest.mark.slow
def test_unprocessed_eagle_chains_drawn_on_the_device_are_exact(
    engines: dict[str, DecodeEngine], plain: dict[str, torch.Tensor]
) -> None:
    """Without processors an EAGLE head's rounds feed each other on the device, read once at
    the end (``EagleDrafter._chains_on_device``): still the target's distribution."""
    got, drafted = _run(engines["eagle"], BASE)
    assert drafted > SAMPLES // 10
    for position in range(1, TOKENS):
        assert _same_distribution(got[:, position], plain["unprocessed"][:, position]) > 0.01
