"""Reported log-probabilities are the target's for every emitted token, whatever drafted it:
equal (1e-4, fp32) to a plain full-sequence forward of the target over prompt and output."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.embedded import embedded_eagle_path
from models.logprobs import TokenLogprob
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from tests.decode.engine_utils import make_request, run_all

TOP = 5


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + 5 * i,), generator=g).tolist() for i in range(n)]


def _check(
    hf: LlamaForCausalLM, reqs: list[Request], out: dict[str, list[int]], got: dict[str, list]
) -> None:
    """Each request's reported logprobs against the target's log-softmax, position by position."""
    for r in reqs:
        tokens, reported = out[r.request_id], got[r.request_id]
        assert [lp.token for lp in reported] == tokens and tokens
        with torch.no_grad():
            logits = hf(torch.tensor([r.prompt_token_ids + tokens])).logits[0]
        n = len(r.prompt_token_ids)
        ref = torch.log_softmax(logits[n - 1 : n - 1 + len(tokens)].float(), dim=-1)  # [T, V]
        for j, lp in enumerate(reported):
            assert isinstance(lp, TokenLogprob)
            assert lp.logprob == pytest.approx(float(ref[j, lp.token]), abs=1e-4)
            assert len(lp.top) == TOP
            kth = float(ref[j].topk(TOP).values[-1])
            for tok, value in lp.top:
                assert value == pytest.approx(float(ref[j, tok]), abs=1e-4)
                assert value >= kth - 1e-4  # really among the most likely
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)


@pytest.fixture(scope="module")
def hf_tiny(tiny_folder: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    ("drafter", "mode"),
    [
        ("none", "colocated"),
        ("self", "colocated"),
        ("self", "disaggregated"),
        ("draft", "disaggregated"),
    ],
)
def test_logprobs_are_the_targets_under_speculation(
    tiny_folder: Path,
    tiny_draft_folder: Path,
    hf_tiny: LlamaForCausalLM,
    drafter: str,
    mode: str,
) -> None:
    """``self``: the target drafts for itself, so most tokens come from multi-token
    verification rows; ``draft``: a different model whose drafts are mostly rejected, so
    tokens come from recovered and bonus rows; greedy and sampled requests share each batch."""
    target = ModelSpec(str(tiny_folder))
    draft_model = {"none": None, "self": target, "draft": ModelSpec(str(tiny_draft_folder))}
    model = draft_model[drafter]
    spec = (
        DraftSpec()
        if model is None
        else DraftSpec(DraftKind.DRAFT_MODEL, model=model, num_speculative_tokens=3, adaptive=False)
    )
    engine = DecodeEngine(DecodeEngineConfig("t", target, spec, num_blocks=128))
    prefill = (
        PrefillWorker(PrefillWorkerConfig("t", target, spec, num_blocks=64))
        if mode == "disaggregated"
        else None
    )
    base = SamplingParams(max_tokens=14, logprobs=TOP)
    params = [
        replace(base, temperature=0.0),
        replace(base, temperature=0.8, top_p=0.9, seed=3, seeded=True),
        replace(base, temperature=1.0, top_k=20, seed=4),
    ]
    reqs = [make_request(p, sp) for p, sp in zip(_prompts(3, 20, seed=5), params, strict=True)]
    got: dict[str, list[TokenLogprob]] = {}
    out = run_all(engine, reqs, prefill=prefill, logprobs=got)
    _check(hf_tiny, reqs, out, got)
    if drafter == "self":
        assert all(r.stats.num_accepted_tokens > 0 for r in reqs)
    if model is not None:
        assert sum(r.stats.num_draft_tokens for r in reqs) > 0
    engine.close()


def test_logprobs_off_report_nothing(tiny_folder: Path) -> None:
    target = ModelSpec(str(tiny_folder))
    engine = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64))
    r = make_request(_prompts(1, 12, seed=6)[0], SamplingParams(temperature=0.0, max_tokens=5))
    got: dict[str, list[TokenLogprob]] = {}
    run_all(engine, [r], logprobs=got)
    assert got.get(r.request_id, []) == []
    engine.close()


def test_logprobs_along_an_accepted_draft_tree(embedded_folder: Path) -> None:
    """A greedy request verifying EAGLE draft trees: each token's row is its parent node's."""
    tok = Tokenizer(embedded_folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "List the days of the week."}])
    head = ModelSpec(str(embedded_eagle_path()))
    spec = DraftSpec(DraftKind.EAGLE, head, 4, adaptive=False, tree_width=4)
    engine = DecodeEngine(
        DecodeEngineConfig("m", ModelSpec(str(embedded_folder)), spec, num_blocks=128)
    )
    r = make_request(prompt, SamplingParams(temperature=0.0, max_tokens=24, logprobs=TOP))
    got: dict[str, list[TokenLogprob]] = {}
    out = run_all(engine, [r], logprobs=got)
    assert r.stats.num_accepted_tokens > 0
    hf = LlamaForCausalLM.from_pretrained(embedded_folder, dtype=torch.float32).eval()
    _check(hf, [r], out, got)
    engine.close()
