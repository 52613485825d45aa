"""The logits processors against hand-computed answers (vLLM's formulas and order), and grammar
states that answer masks along drafts without committing to them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from models.grammar import GrammarCompiler, GrammarError, GrammarSpec
from models.logits_processing import ProcessRow, allowed_tokens, process_logits
from models.sampling import SamplingParams, probs_from_logits
from models.tokenizer import Tokenizer

SP = SamplingParams(stop_token_ids=(0,))


def test_penalties_follow_vllm() -> None:
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    sp = replace(SP, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    got = process_logits(x, [ProcessRow(sp, prompt=[4], before=[1, 1, 3])])
    want = torch.tensor(
        [
            [
                2.0,  # unseen
                -1.0 * 2.0 - 0.25 * 2 - 0.5,  # output twice: negative logit times the penalty
                0.5,
                3.0 / 2.0 - 0.25 - 0.5,  # output once: positive logit divided
                1.0 / 2.0,  # in the prompt only: repetition, no frequency or presence
            ]
        ]
    )
    torch.testing.assert_close(got, want)


def test_logit_bias_and_min_tokens() -> None:
    x = torch.zeros(2, 4)
    sp = replace(SP, logit_bias=((2, 5.0), (3, -100.0)), min_tokens=2, stop_token_ids=(0, 1))
    got = process_logits(x, [ProcessRow(sp, [], [7]), ProcessRow(sp, [], [7, 8])])
    assert got[0].tolist() == [float("-inf"), float("-inf"), 5.0, -100.0]  # one token out
    assert got[1].tolist() == [0.0, 0.0, 5.0, -100.0]  # two out: stopping is allowed


def test_grammar_mask_and_min_tokens_yields_to_it() -> None:
    mask = torch.tensor([[0b0101]], dtype=torch.int32)  # ids 0 and 2
    assert allowed_tokens(mask, 4).tolist() == [[True, False, True, False]]
    only_stop = torch.tensor([0b0001], dtype=torch.int32)
    sp = replace(SP, min_tokens=5)
    got = process_logits(
        torch.zeros(2, 4), [ProcessRow(sp, [], [], mask[0]), ProcessRow(sp, [], [], only_stop)]
    )
    assert got[0].tolist() == [float("-inf"), float("-inf"), 0.0, float("-inf")]
    # the grammar is complete: ending beats min_tokens (else no token could be drawn)
    assert got[1].tolist() == [0.0, float("-inf"), float("-inf"), float("-inf")]


def test_min_p_drops_tokens_under_the_floor_after_temperature() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, [SamplingParams(temperature=1.0, min_p=0.2)])
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    sharp = probs_from_logits(logits, [SamplingParams(temperature=0.5, min_p=0.2)])
    assert sharp[0, 2] == 0.0  # 0.15^2 / 0.5^2 = 0.09 < 0.2


@pytest.fixture(scope="module")
def compiler(embedded_folder: Path) -> GrammarCompiler:
    tok = Tokenizer(embedded_folder)
    return GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids)


def test_masks_along_drafts_match_a_committed_walk(
    compiler: GrammarCompiler, embedded_folder: Path
) -> None:
    tok = Tokenizer(embedded_folder)
    spec = GrammarSpec(
        "json_schema",
        json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
    )
    ids = tok.encode('{"n": 42}')
    state = compiler.state(spec)
    drafted = state.masks([], ids[:-1])  # [len(ids), W], nothing committed
    walk = compiler.state(spec)
    for j in range(len(ids)):
        assert torch.equal(drafted[j], walk.masks(ids[:j], [])[0]), j
    assert state.consumed == 0 and not state.stopped
    bad = state.masks(ids[:2], [tok.encode("x")[0], ids[2]])  # a draft the grammar refuses
    assert bool((bad[1:] == -1).all())  # past it: unconstrained, never reached
    assert torch.equal(bad[0], drafted[2])
    state.sync(ids)  # the refused draft left nothing behind
    assert state.stopped and state.error is None
    fresh = state.fresh()
    assert fresh.consumed == 0 and torch.equal(fresh.masks([], [])[0], drafted[0])


def test_invalid_grammars_are_named(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match="Expected"):
        compiler.state(GrammarSpec("lark", "start: ???"))
    gbnf = compiler.state(GrammarSpec("lark", 'root ::= "yes" | "no"'))  # vLLM's GBNF too
    assert int(allowed_tokens(gbnf.masks([], []), compiler.vocab_size).sum()) >= 2
    before = compiler.cache_size
    compiler.state(GrammarSpec("lark", 'root ::= "yes" | "no"'))
    assert compiler.cache_size == before  # validated once
