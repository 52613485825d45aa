"""Attention over a paged KV cache, in plain torch.

**KV pool** (one tensor per model, owned by ``kvtransfer``; passed in as an argument; its layout
is ``models.kv_layout``)::

    pool: [num_layers, num_blocks, 2, num_kv_heads, block_size, head_dim]

Each block of a layer is one contiguous slab (K of every head, then V), however far apart the
slabs are. Sequences own blocks through a *block table*: token ``p`` of a sequence lives in
block ``table[p // block_size]`` at offset ``p % block_size``.

A forward step may mix sequences with different numbers of new tokens (prompt chunks, one decode
token, k + 1 verification tokens). :class:`AttentionMetadata` is built once per step and shared
by all layers: where each new token's K/V is written, which blocks each sequence attends to,
the causal mask over them, and the rotary angles of the new tokens. A sequence may bring a token
tree instead of a run (``models.tree``): its tokens then attend to their ancestors only, at
their depth's position. Attention runs per group of sequences with similar new-token counts and
context lengths (``AttentionGroup``), each padded to its own longest query and context, so one
long prompt chunk does not make every decode in the step attend with its query length, nor one
long context every short one with its length.

On a CPU, every decode, verification (chain or tree) and prompt chunk of a step reads the
pool in place through one call of a C kernel per layer (``models.cpu_paged``, when the builder
is given the model's ``CpuPagedAttention``); on a GPU, a group of decodes or verifications over
many context tokens reads it in place through ``flex_attention`` (``models.flex_paged``, given
the model's ``FlexPool``). The others gather their blocks into a dense copy per layer
(``_gather``) and run SDPA over it, which on a GPU costs less where the copy is small next to
the queries (long prompt chunks).

**Bucketed steps.** A step of decodes and chain verifications only can instead be laid out in
a fixed *bucket* (``BucketMetadata``): ``b`` sequences of ``q`` query rows each and contexts of
``nb`` blocks, padded, every index a device tensor that the runner fills in place
(``runtime.step_buffers``) and the mask computed on the device from the lengths. Nothing is
built on the host per layer or per step beyond filling the buffers, and the shapes depend on
the bucket alone, so a GPU can capture the whole forward as a CUDA graph per bucket
(``runtime.bucketed``). A padded row writes its source row's K/V to that row's slot again (the
same bytes to the same place), so padding never touches a slot the step does not own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.cpu_paged import CpuPagedAttention, NativeGroup
from models.flex_paged import FlexGroup, FlexPool
from models.layers import rotary_tables
from models.tree import TreeSpan


@dataclass(frozen=True)
class SeqSlice:
    """One sequence in a forward step: `num_new` tokens after `num_cached` cached ones, in the
    slots after them; with ``tree``, the new tokens are that tree's last ``num_new`` nodes."""

    block_table: Sequence[int]
    num_cached: int
    num_new: int
    tree: TreeSpan | None = None

    def __post_init__(self) -> None:
        t = self.tree
        if t is not None and not (
            t.base <= self.num_cached and t.base + t.size == self.num_cached + self.num_new
        ):
            raise ValueError(
                f"a tree over slots {t.base}..{t.base + t.size - 1} does not end with the "
                f"{self.num_new} new tokens after {self.num_cached} cached ones"
            )

    def positions(self) -> list[int]:
        """The rotary position of each new token (num_new of them)."""
        if self.tree is None:
            return list(range(self.num_cached, self.num_cached + self.num_new))
        depths = self.tree.depths()[self.num_cached - self.tree.base :]
        return [self.tree.base + d for d in depths]


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together, their queries padded to one ``[b, q]`` layout and their
    contexts to one length ``C``.

    A step's sequences are grouped by how many new tokens they bring and by how many KV blocks
    they attend over, each in powers of two (1, 2, 3-4, 5-8, ...): a prompt chunk does not pad
    every one-token decode in the step to its length, a k + 1 verification the decodes beside
    it, nor the longest context every short one. Padding wastes at most half of a group's
    query rows and half of its context.
    """

    rows: torch.Tensor | None  # [t] the group's tokens among the step's T; None: all, in order
    tables: torch.Tensor  # [b, NBmax] each sequence's blocks (padded with block 0)
    token_index: torch.Tensor  # [t] index of each token in the padded [b * q] query layout
    mask: torch.Tensor  # [b, 1, q, C] True where a query may attend; C = NBmax * block_size
    num_seqs: int  # b
    max_query: int  # q
    dense: bool  # b == 1 and no padding: the padded layout equals the flat one
    flex: FlexGroup | None = None  # set: the group reads the pool in place (models.flex_paged)


@dataclass(frozen=True)
class AttentionMetadata:
    """Indices shared by every layer of one forward step (B sequences, T new tokens)."""

    positions: torch.Tensor  # [T] rotary position of each new token (its slot, unless a tree)
    slot_blocks: torch.Tensor  # [T] block that receives each new token's K/V
    slot_offsets: torch.Tensor  # [T] offset inside that block
    groups: tuple[AttentionGroup | NativeGroup, ...]  # the sequences, by new-token count
    cos: torch.Tensor  # [T, 1, 2, head_dim / 2] rotary angles of the new tokens
    sin: torch.Tensor  # [T, 1, 2, head_dim / 2] (``models.layers.rotary_tables``)
    # Attention in float64 (``build_attention_metadata``'s ``invariant``): a row's result then
    # does not depend on the other rows and sequences of the call, once rounded back.
    invariant: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])


@dataclass(frozen=True)
class BucketMetadata:
    """Indices of a bucketed step (module docstring): ``b`` sequences of ``q`` rows, contexts of
    ``nb`` blocks. Every tensor is on the device and, but for ``mask``, ``cos`` and ``sin``
    (computed from them), a view of the runner's persistent buffers."""

    slot_blocks: torch.Tensor  # [b * q] block receiving each row's K/V (padding: its source's)
    slot_offsets: torch.Tensor  # [b * q] offset inside that block
    write_rows: torch.Tensor  # [b * q] the row whose K/V each write carries (padding: row 0)
    tables: torch.Tensor  # [b, nb] each sequence's blocks (padding: block 0)
    mask: torch.Tensor  # [b, 1, q, nb * block_size] True where a query row may attend
    cos: torch.Tensor  # [b * q, 1, 2, head_dim / 2] (``models.layers.rotary_tables``)
    sin: torch.Tensor  # [b * q, 1, 2, head_dim / 2]
    num_seqs: int  # b
    max_query: int  # q
    invariant: bool = False  # attention in float64 (``build_attention_metadata``)
    native: NativeGroup | None = None  # set: the CPU kernel reads the pool in place
    flex: FlexGroup | None = None  # set: flex_attention reads the pool in place (GPU)


def bucket_metadata(
    positions: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    write_rows: torch.Tensor,
    tables: torch.Tensor,
    cached: torch.Tensor,
    num_new: torch.Tensor,
    block_size: int,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    window: int | None = None,
    invariant: bool = False,
    native: CpuPagedAttention | None = None,
    flex: FlexPool | None = None,
) -> BucketMetadata:
    """The metadata of a bucket from its buffers, with device ops only (so a CUDA graph can
    hold it): positions, slot_blocks, slot_offsets, write_rows [b * q]; tables [b, nb];
    cached, num_new [b] (a padding sequence brings 0 new tokens). A query row sees the keys at
    or before its position (and within the ``window``, when the model has one); a padding row
    sees key 0 alone, so no softmax row is empty. With ``native`` on a CPU, the kernel of
    ``models.cpu_paged`` attends instead (no graphs there; padding rows come out 0): each row
    then gets the bits of the same step unpadded. With ``flex`` (given on a GPU) and no
    window, ``flex_attention`` reads the pool in place (``FlexPagedAttention.plan_bucket``)
    and the mask above serves only a fallback to the gather path."""
    b, nb = tables.shape
    q = positions.shape[0] // b
    c = nb * block_size
    dev = positions.device
    q_idx = torch.arange(q, device=dev)  # [q]
    q_pos = cached.view(b, 1) + q_idx.view(1, q)  # [b, q]
    valid = q_idx.view(1, q) < num_new.view(b, 1)  # [b, q]
    ctx = torch.arange(c, device=dev).view(1, 1, c)  # [1, 1, C]
    mask = ctx <= q_pos.unsqueeze(2)  # [b, q, C]
    if window is not None:
        mask = mask & (ctx > q_pos.unsqueeze(2) - window)
    mask = (mask & valid.unsqueeze(2)) | (~valid.unsqueeze(2) & (ctx == 0))
    cos, sin = rotary_tables(rope_cos, rope_sin, positions)
    in_place = None
    if native is not None and dev.type == "cpu":
        if native.ready():
            in_place = native.plan_bucket(tables, cached, num_new, q, window)
        else:
            native.fallbacks += 1  # the kernel could not be built here (logged once): gather
    in_flex = None
    if flex is not None and window is None and not invariant and in_place is None:
        in_flex = flex.kernel.plan_bucket(tables, cached, num_new, q, flex, block_size)
    return BucketMetadata(
        slot_blocks=slot_blocks,
        slot_offsets=slot_offsets,
        write_rows=write_rows,
        tables=tables,
        mask=mask.unsqueeze(1),
        cos=cos,
        sin=sin,
        num_seqs=b,
        max_query=q,
        invariant=invariant,
        native=in_place,
        flex=in_flex,
    )


StepMetadata = AttentionMetadata | BucketMetadata


def _pow2_bucket(n: int) -> int:
    """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    return (n - 1).bit_length()


def _tables(seqs: Sequence[SeqSlice], need: Sequence[int]) -> torch.Tensor:
    """[B, NBmax] each sequence's ``need[i]`` blocks for this step, padded with block 0: built
    as one host list and one tensor, since this runs on the host every step."""
    width = max(need)
    rows: list[list[int]] = []
    for s, n in zip(seqs, need, strict=True):
        if len(s.block_table) < n:
            raise ValueError(f"block table holds {len(s.block_table)} blocks, step needs {n}")
        rows.append([*s.block_table[:n], *([0] * (width - n))])
    return torch.tensor(rows, dtype=torch.long)


def _rows(
    seqs: Sequence[SeqSlice], members: Sequence[int], starts: Sequence[int]
) -> torch.Tensor | None:
    """[t] the step's rows of ``seqs[members]`` tokens (``starts[i]``: sequence i's first;
    ``starts[-1]``: T); None when they are the whole step in order (every sequence, in
    order: their rows are then 0 .. T - 1, each sequence bringing at least one token)."""
    if len(members) == len(seqs) and all(m == i for i, m in enumerate(members)):
        return None
    return torch.tensor(
        [r for i in members for r in range(starts[i], starts[i] + seqs[i].num_new)],
        dtype=torch.long,
    )


def _group(
    seqs: Sequence[SeqSlice],
    members: Sequence[int],
    all_tables: torch.Tensor,
    need: Sequence[int],
    starts: Sequence[int],
    block_size: int,
    device: torch.device,
    flex: FlexPool | None,
    window: int | None = None,
) -> AttentionGroup:
    """The padded layout of ``seqs[members]``: ``all_tables`` [B, NBmax] and ``need`` are every
    sequence's blocks, ``starts[i]`` sequence i's first token in the step (``starts[-1]``: T);
    with a sliding ``window``, a query sees only the keys of its last ``window`` positions."""
    part = [seqs[i] for i in members]
    num_new = torch.tensor([s.num_new for s in part])  # [b]
    cached = torch.tensor([s.num_cached for s in part])  # [b]
    b, q = len(part), int(num_new.max())
    idx = torch.tensor(list(members))
    tables = all_tables[idx, : max(need[i] for i in members)]  # [b, NBmax of the group]
    c = tables.shape[1] * block_size
    q_idx = torch.arange(q)  # [q]
    q_valid = q_idx.unsqueeze(0) < num_new.unsqueeze(1)  # [b, q]
    q_pos = cached.unsqueeze(1) + q_idx.unsqueeze(0)  # [b, q]
    ctx_pos = torch.arange(c)  # [C]
    mask = ctx_pos.view(1, 1, c) <= q_pos.unsqueeze(2)  # [b, q, C]
    if window is not None:  # Mistral: key j is seen from query i when i - window < j <= i
        mask &= ctx_pos.view(1, 1, c) > q_pos.unsqueeze(2) - window
    for row, s in enumerate(part):  # a tree's tokens see their ancestors only, inside it
        if s.tree is not None:
            t = s.tree
            anc = t.ancestors()[s.num_cached - t.base :]  # [num_new, tree size]
            mask[row, : s.num_new, t.base : t.base + t.size] &= anc
    # Padded query rows attend to slot 0 only, so no row of the softmax is empty (no NaN).
    mask = (mask & q_valid.unsqueeze(2)) | (~q_valid.unsqueeze(2) & (ctx_pos == 0).view(1, 1, c))
    token_index = (torch.arange(b).unsqueeze(1) * q + q_idx.unsqueeze(0))[q_valid]  # [t]
    rows = _rows(seqs, members, starts)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    in_place = None
    if flex is not None:  # the builder chose these members for the in-place kernel
        group_need = torch.tensor([need[i] for i in members])  # [b]
        in_place = flex.kernel.plan(tables, group_need, cached, flex, block_size, device)
    return AttentionGroup(
        rows=None if rows is None else dev(rows),
        tables=dev(tables),
        token_index=dev(token_index),
        mask=dev(mask.unsqueeze(1)),
        num_seqs=b,
        max_query=q,
        dense=b == 1,
        flex=in_place,
    )


def build_attention_metadata(
    seqs: Sequence[SeqSlice],
    block_size: int,
    device: torch.device,
    rope_cos: torch.Tensor,
    rope_sin: torch.Tensor,
    flex: FlexPool | None = None,
    window: int | None = None,
    invariant: bool = False,
    native: CpuPagedAttention | None = None,
) -> AttentionMetadata:
    """Index tensors for one step over ``seqs`` (in the order their tokens appear in the batch).

    With ``native`` (on a CPU), every sequence it ``fits`` goes into one group that reads the
    pool in place (``models.cpu_paged``), whatever its length, tree or window; the flex kernel
    is then not used. Else, with ``flex``, the groups it serves read the pool in place
    (``models.flex_paged``); with a sliding ``window`` (``LlamaConfig.sliding_window``) those
    gather: the flex kernel's block masks have no window.

    ``invariant`` computes attention in float64. SDPA's CPU kernels round a row differently
    depending on how many query rows and sequences share the call (in the last bits), so a
    verification of k + 1 tokens and k + 1 single decodes differ in the last bits. In float32
    that rarely moves an argmax; a model whose activations are rounded to 16 bits (bf16, or
    int8 weights, whose kernel takes bf16) amplifies it into different greedy tokens. In
    float64 the difference is far below what rounding back to float32 keeps, so speculation
    stays token-identical to plain decoding. Those groups gather, but for the ``native`` group,
    whose kernel gives a row the same bits whatever shares its call, and a tree's node the bits
    of the chain it becomes."""
    if not seqs or any(s.num_new <= 0 for s in seqs):
        raise ValueError("every sequence in a step must bring at least one new token")
    need = [(s.num_cached + s.num_new + block_size - 1) // block_size for s in seqs]
    tables = _tables(seqs, need)  # [B, NBmax]: every sequence's blocks
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.num_new)
    # Per token, built as host lists and made tensors once: rotary position, and the block
    # and offset of the slot that receives its K/V.
    positions = [p for s in seqs for p in s.positions()]
    blocks: list[int] = []
    offsets: list[int] = []
    for s in seqs:
        for slot in range(s.num_cached, s.num_cached + s.num_new):
            blocks.append(s.block_table[slot // block_size])
            offsets.append(slot % block_size)
    # Sequences attended together: alike in new tokens and in context blocks, to a factor 2.
    # Decodes and verifications the in-place kernel serves go together, whatever their
    # lengths: it pads neither queries (each sequence has its own query block) nor contexts.
    in_place: list[int] = []
    on_cpu: list[int] = []
    if native is not None and device.type == "cpu":
        if native.ready():
            on_cpu = [i for i, s in enumerate(seqs) if native.fits(block_size, s)]
        else:
            native.fallbacks += 1  # the kernel could not be built here (logged once): gather
    elif flex is not None and window is None and not invariant:
        fits = [i for i, s in enumerate(seqs) if flex.kernel.fits(flex.group_size, s)]
        if flex.kernel.applies(sum(need[i] for i in fits) * block_size):
            in_place = fits
    by_bucket: dict[tuple[int, int], list[int]] = {}
    taken = set(in_place) | set(on_cpu)
    for i, s in enumerate(seqs):
        if i not in taken:
            by_bucket.setdefault((_pow2_bucket(s.num_new), _pow2_bucket(need[i])), []).append(i)
    gathered = (
        _group(seqs, members, tables, need, starts, block_size, device, None, window)
        for _, members in sorted(by_bucket.items())
    )
    groups: tuple[AttentionGroup | NativeGroup, ...] = tuple(gathered)
    if in_place:
        groups = (_group(seqs, in_place, tables, need, starts, block_size, device, flex), *groups)
    if on_cpu:
        assert native is not None
        rows = _rows(seqs, on_cpu, starts)
        group_tables = (
            tables
            if len(on_cpu) == len(seqs)
            else tables[torch.tensor(on_cpu), : max(need[i] for i in on_cpu)]
        )
        part = [seqs[i] for i in on_cpu]
        groups = (native.plan(part, group_tables, rows, window), *groups)
    pos_dev = torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True)  # [T]
    cos, sin = rotary_tables(rope_cos, rope_sin, pos_dev)
    return AttentionMetadata(
        positions=pos_dev,
        slot_blocks=torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True),  # [T]
        slot_offsets=torch.tensor(offsets, dtype=torch.long).to(device, non_blocking=True),
        groups=groups,
        cos=cos,
        sin=sin,
        invariant=invariant,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_kv: torch.Tensor,
    meta: StepMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the step's K/V into the pool, then attend over each sequence's cached context.

    q: [T, Hq, D]; k, v: [T, Hkv, D]; layer_kv: [num_blocks, 2, Hkv, block_size, D] (one layer
    of the pool). Returns [T, Hq * D]. A bucketed step's T is its ``b * q`` rows.
    """
    if isinstance(meta, BucketMetadata):
        return _bucket_attention(q, k, v, layer_kv, meta, scale)
    first = meta.groups[0] if meta.groups else None
    if not (
        isinstance(first, NativeGroup)  # a CPU step: its kernel writes in one call
        and first.kernel.write(k, v, layer_kv, meta.slot_blocks, meta.slot_offsets)
    ):
        layer_kv[meta.slot_blocks, :, :, meta.slot_offsets] = torch.stack((k, v), 1)
    exact = meta.invariant
    if len(meta.groups) == 1 and meta.groups[0].rows is None:
        return _attend_any(q, layer_kv, meta.groups[0], scale, exact)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])  # [T, Hq * D]
    for g in meta.groups:
        assert g.rows is not None  # only a lone group covering the whole step has none
        out[g.rows] = _attend_any(q[g.rows], layer_kv, g, scale, exact)
    return out


def _attend_any(
    q: torch.Tensor,
    layer_kv: torch.Tensor,
    g: AttentionGroup | NativeGroup,
    scale: float,
    exact: bool,
) -> torch.Tensor:
    """One group's attention, q: [t, Hq, D] -> [t, Hq * D], by the kernel its group names."""
    if isinstance(g, NativeGroup):
        return g.kernel.attend(q, layer_kv, g, scale)
    return _attend(q, layer_kv, g, scale, exact)


def _bucket_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_kv: torch.Tensor,
    meta: BucketMetadata,
    scale: float,
) -> torch.Tensor:
    """A bucketed step's attention: q: [b * q, Hq, D]; k, v: [b * q, Hkv, D] -> [b * q, Hq * D].
    Static shapes and device indices only."""
    new = torch.stack((k, v), 1)[meta.write_rows]  # [b * q, 2, Hkv, D]
    layer_kv[meta.slot_blocks, :, :, meta.slot_offsets] = new
    b, qn = meta.num_seqs, meta.max_query
    _rows, hq, d = q.shape
    if meta.native is not None:
        out = q.new_zeros(b * qn, hq * d)  # [b * q, Hq * D]: padding rows stay 0
        return meta.native.kernel.attend(q, layer_kv, meta.native, scale, out)
    if meta.flex is not None:
        found = meta.flex.kernel.attend(q.view(b, qn, hq, d), layer_kv, meta.flex, scale)
        if found is not None:  # [b, q, Hq, D]
            return found.reshape(b * qn, hq * d)
    keys, values = _gather(layer_kv, meta.tables)  # [b, Hkv, C, D] each
    queries = q.view(b, qn, hq, d).transpose(1, 2)  # [b, Hq, q, D]
    if meta.invariant:
        queries, keys, values = queries.double(), keys.double(), values.double()
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=hq != keys.shape[1]
    ).to(q.dtype)  # [b, Hq, q, D]
    return out.transpose(1, 2).reshape(b * qn, hq * d)


def _gather(layer_kv: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The blocks of ``tables`` [b, NBmax] end to end, per sequence, K/V and head:
    layer_kv [NB, 2, Hkv, BS, D] -> [2, b, Hkv, NBmax * BS, D] (a view of one copy).

    One ``index_select`` over the blocks dimension of the pool seen as [2, Hkv, NB, BS, D]:
    it copies whole ``BS * D`` runs straight into the (K/V, head)-major order attention
    wants, one op where a gather of whole blocks would need a second copy to bring the heads
    in front of the tokens, and a select per (K/V, head) costs an op each."""
    _nb, _two, hkv, bs, d = layer_kv.shape
    b, nbmax = tables.shape
    out = torch.index_select(layer_kv.permute(1, 2, 0, 3, 4), 2, tables.reshape(-1))
    return out.view(2, hkv, b, nbmax * bs, d).transpose(1, 2)  # [2, b, Hkv, C, D]


def _attend(
    q: torch.Tensor, layer_kv: torch.Tensor, g: AttentionGroup, scale: float, exact: bool
) -> torch.Tensor:
    """One group's attention (in float64 when ``exact``). q: [t, Hq, D]; layer_kv:
    [NB, 2, Hkv, BS, D]. Returns [t, Hq * D]."""
    _t, hq, d = q.shape
    hkv = layer_kv.shape[2]
    b, qn = g.num_seqs, g.max_query
    if g.dense:
        qp = q.unsqueeze(0)  # [1, t, Hq, D]
    else:
        qp = q.new_zeros(b * qn, hq, d)
        qp[g.token_index] = q
        qp = qp.view(b, qn, hq, d)
    if g.flex is not None:
        found = g.flex.kernel.attend(qp, layer_kv, g.flex, scale)  # [b, q, Hq, D]
        if found is not None:
            flat = found.reshape(b * qn, hq * d)
            return flat if g.dense else flat[g.token_index]
    keys, values = _gather(layer_kv, g.tables)  # [b, Hkv, C, D] each
    queries = qp.transpose(1, 2)  # [b, Hq, q, D]
    if exact:
        queries, keys, values = queries.double(), keys.double(), values.double()
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=g.mask, scale=scale, enable_gqa=hq != hkv
    ).to(q.dtype)  # [b, Hq, q, D]
    out = out.transpose(1, 2).reshape(b * qn, hq * d)
    return out if g.dense else out[g.token_index]
