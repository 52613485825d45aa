"""What the attention tests share: a backend's spec for one layer of a pool, and the steps the
conformance test runs every backend over."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.attention.metadata import AttentionSpec, SeqSlice
from models.kv_layout import block_chunks
from models.layers import RotaryEmbedding
from models.tree import TreeSpan


def layer_spec(
    layer_kv: torch.Tensor, group_size: int, window: int | None = None, positions: int = 4096
) -> AttentionSpec:
    """The spec of a model with ``group_size`` query heads per KV head over one layer
    ``layer_kv`` [NB, 2, Hkv, BS, D] of a pool."""
    nb, _two, hkv, bs, d = layer_kv.shape
    rope = RotaryEmbedding(d, positions, 10000.0, layer_kv.device)
    return AttentionSpec(
        block_size=bs,
        group_size=group_size,
        head_dim=d,
        num_kv_heads=hkv,
        num_blocks=nb,
        block_chunks=block_chunks(layer_kv),
        rope_cos=rope.cos,
        rope_sin=rope.sin,
        device=layer_kv.device,
        window=window,
    )


def in_block_major(layer: torch.Tensor, layers: int = 3) -> torch.Tensor:
    """``layer`` [NB, 2, Hkv, BS, D] copied into the middle layer of a block-major pool (as
    ``kvtransfer.pool`` lays one out); the other layers hold NaN, so a stray read shows."""
    pool = torch.full((layer.shape[0], layers, *layer.shape[1:]), float("nan"), dtype=layer.dtype)
    pool[:, layers // 2] = layer
    return pool[:, layers // 2]


@dataclass(frozen=True)
class StepCase:
    """One step's sequences, by kind."""

    name: str
    shapes: tuple[tuple[int, int], ...]  # (cached, new) per chain sequence
    tree: bool = False  # and a draft tree after 100 cached tokens

    def seqs(self, num_blocks: int, block_size: int, gen: torch.Generator) -> list[SeqSlice]:
        """The sequences over blocks in shuffled order (block 0 left to padding)."""
        perm = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
        out, start = [], 0
        for cached, new in self.shapes:
            n = (cached + new + block_size - 1) // block_size
            out.append(SeqSlice(perm[start : start + n], cached, new))
            start += n
        if self.tree:  # 6 nodes from slot 98: two cached, four new
            tree = TreeSpan(98, (-1, 0, 1, 1, 2, 3))
            n = (98 + 6 + block_size - 1) // block_size
            out.append(SeqSlice(perm[start : start + n], 100, 4, tree))
        return out


CASES = (
    StepCase("decodes", ((300, 1), (16, 1), (517, 1), (7, 1), (250, 1))),
    StepCase("verifications", ((300, 5), (517, 3), (16, 2), (250, 8))),
    StepCase("prompt_chunks", ((0, 40), (40, 24), (0, 400), (17, 3))),
    StepCase("tree", ((300, 1),), tree=True),
    StepCase("mixed", ((300, 1), (517, 5), (16, 1), (250, 3), (40, 24), (0, 400)), tree=True),
)
