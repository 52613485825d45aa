"""Draft trees (``draft.tree_width``) with the embedded model and its shipped EAGLE head: greedy
output stays the target's, and trees accept more tokens per verifying forward than chains."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from decode.tree_verify import accept_greedy_path
from models.embedded import embedded_eagle_path
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from tests.decode.engine_utils import make_request, run_all

PROMPTS = (
    "Explain what a hash table is and when to use one.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation?",
)


def test_the_walk_follows_the_targets_tokens_down_any_branch() -> None:
    # root -> 10 (0) -> 11 (1);  root -> 20 (2) -> 21 (3), 22 (4)
    tokens, parents = (10, 11, 20, 21, 22), (-1, 0, -1, 2, 2)
    # the target's token after: root, node 0, 1, 2, 3, 4
    assert accept_greedy_path([20, 0, 0, 22, 0, 7], tokens, parents) == ([2, 4], 7)
    assert accept_greedy_path([10, 11, 5, 0, 0, 0], tokens, parents) == ([0, 1], 5)
    assert accept_greedy_path([30, 0, 0, 0, 0, 0], tokens, parents) == ([], 30)


def _run(folder: Path, draft: DraftSpec, prompts: list[list[int]]) -> tuple[list, list[Request]]:
    engine = DecodeEngine(DecodeEngineConfig("m", ModelSpec(str(folder)), draft, num_blocks=256))
    reqs = [make_request(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in prompts]
    out = run_all(engine, reqs)
    engine.close()
    return [out[r.request_id] for r in reqs], reqs


def _per_forward(reqs: list[Request]) -> float:
    return sum(r.stats.num_emitted_tokens for r in reqs) / sum(r.stats.num_steps for r in reqs)


@pytest.mark.slow
def test_trees_keep_greedy_output_and_accept_more_per_forward(embedded_folder: Path) -> None:
    tok = Tokenizer(embedded_folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    head = ModelSpec(str(embedded_eagle_path()))
    off, _ = _run(embedded_folder, DraftSpec(), prompts)

    def spec(width: int) -> DraftSpec:
        return DraftSpec(DraftKind.EAGLE, head, 4, adaptive=False, tree_width=width)

    chain, chain_reqs = _run(embedded_folder, spec(1), prompts)
    tree, tree_reqs = _run(embedded_folder, spec(4), prompts)
    assert tree == chain == off
    # The head's top token at each depth is usually in its tree, and other branches add hits.
    assert _per_forward(tree_reqs) > _per_forward(chain_reqs) > 1.0
