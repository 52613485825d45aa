"""Token trees in the paged forward: each root-to-node path computes what it would as a chain,
and compacting the accepted path leaves the cache a chain would have left."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.kv_layout import kv_pool_shape
from models.llama import LlamaModel
from models.spec import ModelSpec
from models.tree import TreeSpan, chain_parents, path_moves
from runtime.runner import LocalRunner, SeqInput

BS = 4  # small blocks, so trees and moves cross block boundaries
TOL = 1e-4


def _pool(folder: Path) -> tuple[LlamaModel, torch.Tensor]:
    model = ModelSpec(str(folder)).load()
    c = model.cfg
    return model, torch.zeros(kv_pool_shape(32, c.num_kv_heads, c.num_layers, BS, c.head_dim))


def test_tree_parents_must_come_first() -> None:
    with pytest.raises(ValueError, match="parents must come first"):
        TreeSpan(0, (-1, 2, 0))
    t = TreeSpan(5, (-1, 0, 0, 1, -1))
    assert t.depths() == [0, 1, 1, 2, 0]
    assert t.ancestors()[3].tolist() == [True, True, False, True, False]


def test_every_tree_path_equals_its_chain_and_the_compacted_cache_continues_it(
    tiny_folder: Path,
) -> None:
    model, pool = _pool(tiny_folder)
    step = LocalRunner(model, pool, BS).run
    prompt = [5, 9, 13, 2, 7, 11, 3]
    table = [7, 2, 9, 4, 11, 6]
    step([SeqInput(table, 0, prompt, [])])
    n = len(prompt)
    # The pending token 40 is the root; then two branches with a shared first draft:
    #   40 -> 21 -> 22 -> 23   and   40 -> 21 -> 30,   and 40 -> 50 -> 51
    tokens = [40, 21, 22, 23, 30, 50, 51]
    parents = (-1, 0, 1, 2, 1, 0, 5)
    tree = step([SeqInput(table, n, tokens, list(range(7)), TreeSpan(n, parents))]).logits  # [7, V]
    paths = {3: [0, 1, 2, 3], 4: [0, 1, 4], 6: [0, 5, 6]}
    other = [3, 8, 10, 5, 1, 12]  # another sequence's blocks, same prompt
    for leaf, path in paths.items():
        step([SeqInput(other, 0, prompt, [])])
        chain = step([SeqInput(other, n, [tokens[i] for i in path], list(range(len(path))))]).logits
        assert (tree[path] - chain).abs().max().item() <= TOL, leaf
    # Accept 40 -> 50 -> 51 in the tree; compacted, the next token sees the chain's cache.
    moves = path_moves(n, [0, 5, 6])
    assert moves == ((n + 5, n + 1), (n + 6, n + 2))
    after_tree = step([SeqInput(table, n + 3, [8], [0], kv_moves=moves)]).logits
    step([SeqInput(other, 0, [*prompt, 40, 50, 51], [])])
    after_chain = step([SeqInput(other, n + 3, [8], [0])]).logits
    assert (after_tree - after_chain).abs().max().item() <= TOL


def test_a_chain_tree_is_a_chain(tiny_folder: Path) -> None:
    model, pool = _pool(tiny_folder)
    step = LocalRunner(model, pool, BS).run
    ids = [4, 8, 15, 16, 23, 42]
    a = step([SeqInput([1, 2], 0, ids, list(range(6)))]).logits
    b = step([SeqInput([3, 5], 0, ids, list(range(6)), TreeSpan(0, chain_parents(6)))]).logits
    assert (a - b).abs().max().item() <= TOL
