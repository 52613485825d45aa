"""The packed step inputs a TP group broadcasts rebuild the batch exactly."""

from __future__ import annotations

import torch

from models.tree import TreeSpan
from runtime.runner import SeqInput
from runtime.step_wire import pack, unpack


def test_a_ragged_batch_with_trees_and_moves_round_trips() -> None:
    batch = [
        SeqInput([3, 9, 4], 20, [5, 6, 7], [0, 1, 2]),
        SeqInput([1], 0, [42] * 9, []),  # a prompt chunk: no logits wanted
        SeqInput([7, 8], 17, [11, 12, 13, 14], [0, 1, 2, 3], TreeSpan(17, (-1, 0, 0, 1))),
        SeqInput([2, 5], 30, [1], [0], kv_moves=((31, 30), (33, 31))),
    ]
    flat = pack(batch)
    assert flat.dtype == torch.long and flat.dim() == 1
    back = unpack(flat)
    assert [tuple(s.block_table) for s in back] == [tuple(s.block_table) for s in batch]
    for got, want in zip(back, batch, strict=True):
        assert (got.num_cached, list(got.token_ids), list(got.logit_positions)) == (
            want.num_cached,
            list(want.token_ids),
            list(want.logit_positions),
        )
        assert got.tree == want.tree and tuple(got.kv_moves) == tuple(want.kv_moves)
    assert unpack(pack([])) == []
