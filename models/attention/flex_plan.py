"""Block masks that let ``flex_attention`` read the pool in place. A layer [NB, 2, Hkv, BS, D]
is seen as one run of BS-row chunks: chunk ``b * S + h`` (S = ``block_chunks``) is head h's
keys of block b; the values view starts Hkv chunks later. A query block is one tile of a
sequence's new tokens under one KV head, row ``t * G + g``. Each query block lists the chunks
some of its rows see (masked) and those all of them see (full), both ranges of the sequence's
blocks; the mask_mod resolves causality, the sliding window and a draft tree's ancestry."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from models.attention.metadata import AttentionSpec, SeqSlice

QUERY_BLOCK = 16  # query rows a tile of decodes, verifications and small trees
PROMPT_QUERY_BLOCK = 64  # query rows a tile of prompt chunks (and large trees)
NO_TREE = 1 << 40  # a chain's "tree base": past every slot

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FlexPlan:
    block_mask: BlockMask
    num_query_blocks: int  # before padding
    group_size: int
    query_block: int = QUERY_BLOCK
    # [t * Hq] each query head's row among the padded ones (ragged); None: a bucket's layout,
    # one query block per (sequence, KV head), sequence-major
    rows: torch.Tensor | None = None

    @property
    def padded(self) -> int:
        return int(self.block_mask.kv_num_blocks.shape[-1])


@dataclass(frozen=True)
class TreeRows:
    """A step's draft trees for the mask: per query block the tree's first slot (NO_TREE for
    chains) and its first row in ``ancestors`` [R, M] (node, node-relative slot)."""

    base: torch.Tensor
    start: torch.Tensor
    ancestors: torch.Tensor


def key_chunks(spec: AttentionSpec) -> int:
    return (spec.num_blocks - 1) * spec.block_chunks + spec.num_kv_heads


def kv_lists(lists: torch.Tensor, padded: int, width: int) -> torch.Tensor:
    """lists [n, m] -> the [1, 1, padded, width] view BlockMask wants, without copying rows."""
    n, m = lists.shape
    store = torch.zeros(padded * m + width, dtype=torch.int32, device=lists.device)
    store[: n * m] = lists.reshape(n * m).to(torch.int32)
    return store.as_strided((1, 1, padded, width), (0, 0, m, 1))


def visible(
    first: torch.Tensor,
    logical: torch.Tensor,
    query_block: int,
    spec: AttentionSpec,
    tree: TreeRows | None = None,
) -> MaskMod:
    """first: [P] each query block's first slot; logical: [>= NB] each pool block's index in the
    sequence that reads it. A row sees the slots at or before its own, inside the window, and in
    a tree only its ancestors."""
    g, bs, window = spec.group_size, spec.block_size, spec.window
    chunk_rows = bs * spec.block_chunks

    def mask_mod(
        _b: torch.Tensor, _h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        qb, token = q // query_block, (q % query_block) // g
        slot = first[qb] + token
        key = logical[kv // chunk_rows] * bs + kv % bs
        seen = key <= slot
        if window is not None:
            seen = seen & (key > slot - window)
        if tree is not None:
            base = tree.base[qb]
            rows, width = tree.ancestors.shape
            node = (tree.start[qb] + token).clamp(max=rows - 1)
            rel = (key - base).clamp(0, width - 1)
            seen = seen & ((key < base) | tree.ancestors[node, rel])
        return seen

    return mask_mod


def block_ranges(
    s0: torch.Tensor, s1: torch.Tensor, tree_base: torch.Tensor, spec: AttentionSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query block with rows at slots s0..s1: blocks [u0, u1) hold a key some row sees, and
    [f0, f1) inside them keys every row sees (empty: f0 = f1 = u0). Device ops only."""
    bs, w = spec.block_size, spec.window
    lo = s0 if w is None else (s0 - w + 1).clamp(min=0)
    u0 = torch.zeros_like(s0) if w is None else lo // bs
    u1 = s1 // bs + 1
    lo_full = torch.zeros_like(s0) if w is None else (s1 - w + 1).clamp(min=0)
    f0 = (lo_full + bs - 1) // bs
    f1 = (torch.minimum(s0, tree_base - 1) + 1) // bs
    empty = f1 <= f0
    return u0, u1, torch.where(empty, u0, f0), torch.where(empty, u0, f1)


def range_lists(
    u0: torch.Tensor, u1: torch.Tensor, f0: torch.Tensor, f1: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[P] ranges -> (masked [P, width] block indices, their count, full ..., count): masked is
    [u0, f0) then [f1, u1), left-aligned; entries past a count repeat the last valid index."""
    k = torch.arange(width, device=u0.device).view(1, width)
    before = (f0 - u0).view(-1, 1)
    masked = torch.where(k < before, u0.view(-1, 1) + k, f1.view(-1, 1) + k - before)
    n_masked = (f0 - u0) + (u1 - f1)
    full = f0.view(-1, 1) + k
    top = (u1 - 1).clamp(0, width - 1).view(-1, 1)
    return masked.clamp(max=top), n_masked, full.clamp(max=top), f1 - f0


def _padded(n: int) -> int:
    return max(4, 1 << (n - 1).bit_length())


def _mask(
    tables: torch.Tensor,
    heads: torch.Tensor,
    ranges: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    padded: int,
    query_block: int,
    mask_mod: MaskMod,
    spec: AttentionSpec,
) -> BlockMask:
    """tables [P, nb] each query block's sequence's blocks, heads [P] its KV head."""
    nq, nb = tables.shape
    width = key_chunks(spec)
    masked, n_masked, full, n_full = range_lists(*ranges, nb)
    chunks = tables * spec.block_chunks + heads.view(nq, 1)

    def counts(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(padded, dtype=torch.int32, device=x.device)
        out[:nq] = x.to(torch.int32)
        return out.view(1, 1, padded)

    return BlockMask.from_kv_blocks(
        counts(n_masked),
        kv_lists(chunks.gather(1, masked), padded, width),
        counts(n_full),
        kv_lists(chunks.gather(1, full), padded, width),
        BLOCK_SIZE=(query_block, spec.block_size),
        mask_mod=mask_mod,
        seq_lengths=(padded * query_block, width * spec.block_size),
        compute_q_blocks=False,
    )


def _trees(
    seqs: Sequence[SeqSlice], seq_of: torch.Tensor, tile: torch.Tensor, tokens: int, nq: int
) -> TreeRows | None:
    """The step's trees, laid out per query block (tile-major, KV heads inner)."""
    if all(s.tree is None for s in seqs):
        return None
    base = torch.full((len(seqs),), NO_TREE, dtype=torch.long)
    start = torch.zeros(len(seqs), dtype=torch.long)
    blocks: list[torch.Tensor] = []
    rows = 0
    for i, s in enumerate(seqs):
        if s.tree is not None:
            base[i], start[i] = s.tree.base, rows
            blocks.append(s.tree.ancestors()[s.num_cached - s.tree.base :])
            rows += s.num_new
    # padded to powers of two: every shape is another compiled kernel
    width = max(16, 1 << (max(b.shape[1] for b in blocks) - 1).bit_length())
    anc = torch.zeros(max(16, 1 << (rows - 1).bit_length()), width, dtype=torch.bool)
    at = 0
    for b in blocks:
        anc[at : at + b.shape[0], : b.shape[1]] = b
        at += b.shape[0]
    heads = nq // seq_of.shape[0]
    per_block = torch.zeros(_padded(nq), dtype=torch.long)
    per_start = torch.zeros(_padded(nq), dtype=torch.long)
    per_block[:nq] = base[seq_of].repeat_interleave(heads)
    per_start[:nq] = (start[seq_of] + tile * tokens).repeat_interleave(heads)
    return TreeRows(per_block, per_start, anc)


def plan_ragged(
    seqs: Sequence[SeqSlice], tables: torch.Tensor, spec: AttentionSpec, query_block: int
) -> FlexPlan:
    """A ragged group's plan, built on the host: ``seqs`` with their ``tables`` [b, nb]; each
    sequence's new tokens in tiles of ``query_block // G``, a query block per tile and KV head."""
    h, g, dev = spec.num_kv_heads, spec.group_size, spec.device
    tokens = query_block // g
    b = len(seqs)
    new = torch.tensor([s.num_new for s in seqs])
    cached = torch.tensor([s.num_cached for s in seqs])
    tiles = (new + tokens - 1) // tokens
    seq_of = torch.repeat_interleave(torch.arange(b), tiles)  # [S] each tile's sequence
    tile = torch.arange(seq_of.shape[0]) - (torch.cumsum(tiles, 0) - tiles)[seq_of]
    s0 = cached[seq_of] + tile * tokens
    s1 = torch.minimum((cached + new)[seq_of], s0 + tokens) - 1
    trees = _trees(seqs, seq_of, tile, tokens, seq_of.shape[0] * h)
    tree_base = torch.full_like(s0, NO_TREE)
    for i, s in enumerate(seqs):
        if s.tree is not None:
            tree_base[seq_of == i] = s.tree.base
    nq = seq_of.shape[0] * h
    padded = _padded(nq)

    def per_block(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(h)

    ranges = block_ranges(per_block(s0), per_block(s1), per_block(tree_base), spec)
    heads = torch.arange(h).repeat(seq_of.shape[0])
    nb = tables.shape[1]
    need = (cached + new + spec.block_size - 1) // spec.block_size
    used = torch.arange(nb).view(1, nb) < need.view(b, 1)
    logical = torch.zeros(spec.num_blocks, dtype=torch.long)
    logical[tables[used]] = torch.arange(nb).view(1, nb).expand(b, nb)[used]
    first = torch.zeros(padded, dtype=torch.long)
    first[:nq] = per_block(s0)
    if trees is not None:
        trees = TreeRows(trees.base.to(dev), trees.start.to(dev), trees.ancestors.to(dev))
    mask_mod = visible(first.to(dev), logical.to(dev), query_block, spec, trees)
    u0, u1, f0, f1 = (r.to(dev) for r in ranges)
    rows = tables[seq_of].repeat_interleave(h, 0).to(dev)
    mask = _mask(rows, heads.to(dev), (u0, u1, f0, f1), padded, query_block, mask_mod, spec)
    # each new token's query heads: tile-major query block, row (token in tile) * G + g
    tile_first = torch.cumsum(tiles, 0) - tiles
    tok_seq = torch.repeat_interleave(torch.arange(b), new)
    local = torch.arange(tok_seq.shape[0]) - (torch.cumsum(new, 0) - new)[tok_seq]
    block = (tile_first[tok_seq] + local // tokens) * h  # [t] its query block under head 0
    row = (block.view(-1, 1, 1) + torch.arange(h).view(1, h, 1)) * query_block
    row = row + (local % tokens).view(-1, 1, 1) * g + torch.arange(g).view(1, 1, g)
    return FlexPlan(mask, nq, g, query_block, row.reshape(-1).to(dev))


def plan_bucket(
    tables: torch.Tensor,
    cached: torch.Tensor,
    num_new: torch.Tensor,
    query: int,
    spec: AttentionSpec,
) -> FlexPlan:
    """A bucket's plan with device ops only (CUDA graphs): ``b`` sequences of ``query`` rows,
    one query block per (sequence, KV head); padding sequences bring 0 new tokens."""
    b, nb = tables.shape
    h, g, dev = spec.num_kv_heads, spec.group_size, tables.device
    nq = b * h
    qb = max(QUERY_BLOCK, 1 << (g * query - 1).bit_length())
    padded = _padded(nq)
    s0 = cached.view(b, 1).expand(b, h).reshape(nq)
    s1 = (cached + (num_new - 1).clamp(min=0)).view(b, 1).expand(b, h).reshape(nq)
    ranges = block_ranges(s0, s1, torch.full_like(s0, NO_TREE), spec)
    # blocks past a sequence's need scatter to a spare entry, not a used one
    need = (cached + num_new + spec.block_size - 1) // spec.block_size
    j = torch.arange(nb, device=dev)
    used = j.view(1, nb) < need.view(b, 1)
    spare = spec.num_blocks
    target = torch.where(used, tables, spare).reshape(-1)
    logical = torch.zeros(spare + 1, dtype=torch.long, device=dev)
    logical.scatter_(0, target, j.view(1, nb).expand(b, nb).reshape(-1))
    first = torch.zeros(padded, dtype=torch.long, device=dev)
    first[:nq] = s0
    # a padding sequence (0 new tokens) lists nothing: its rows are dropped
    empty = (num_new == 0).view(b, 1).expand(b, h).reshape(nq)
    u0, u1, f0, f1 = ranges
    ranges = (u0, torch.where(empty, u0, u1), f0, torch.where(empty, u0, f1))
    heads = torch.arange(h, device=dev).repeat(b)
    rows = tables.repeat_interleave(h, 0)
    mask = _mask(rows, heads, ranges, padded, qb, visible(first, logical, qb, spec), spec)
    return FlexPlan(mask, nq, g, qb)
