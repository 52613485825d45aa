"""A step's inputs as one int64 tensor, broadcast from TP rank 0 to the others. Layout: ``B``,
then per sequence 7 header ints (see ``pack``), then per sequence its lists in that order."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.tree import TreeSpan
from runtime.runner import SeqInput

HEADER = 7


def pack(batch: Sequence[SeqInput]) -> torch.Tensor:
    """[N] int64 on the CPU: everything ``unpack`` needs to rebuild ``batch``."""
    head: list[int] = [len(batch)]
    data: list[int] = []
    for s in batch:
        tree = s.tree
        head += [
            len(s.block_table),
            s.num_cached,
            len(s.token_ids),
            len(s.logit_positions),
            -1 if tree is None else tree.size,
            -1 if tree is None else tree.base,
            len(s.kv_moves),
        ]
        data += s.block_table
        data += s.token_ids
        data += s.logit_positions
        if tree is not None:
            data += tree.parents
        for src, dst in s.kv_moves:
            data += (src, dst)
    return torch.tensor(head + data, dtype=torch.long)


def unpack(flat: torch.Tensor) -> list[SeqInput]:
    """The batch ``pack`` packed (flat: [N] int64, on any device)."""
    v = flat.tolist()
    b = v[0]
    at = 1 + HEADER * b
    out = []
    for i in range(b):
        blocks, cached, tokens, logits, parents, base, moves = v[
            1 + HEADER * i : 1 + HEADER * (i + 1)
        ]
        table = v[at : at + blocks]
        at += blocks
        ids = v[at : at + tokens]
        at += tokens
        rows = v[at : at + logits]
        at += logits
        tree = None
        if parents >= 0:
            tree = TreeSpan(base, tuple(v[at : at + parents]))
            at += parents
        pairs = v[at : at + 2 * moves]
        at += 2 * moves
        kv_moves = tuple(zip(pairs[0::2], pairs[1::2], strict=True))
        out.append(SeqInput(table, cached, ids, rows, tree, kv_moves))
    return out
