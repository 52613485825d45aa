"""The block-mask kernel of the flex backend: PyTorch's ``flex_attention`` reading the pool
in place.

The reference path copies every context block into a dense tensor per layer before attention
reads it again; at long contexts and large batches that copy is most of the step.
``flex_attention`` (a maintained PyTorch kernel, compiled by inductor
to C++ on a CPU and to Triton on a GPU) instead walks a *block mask*: for each block of query
rows, the list of KV blocks it reads, straight out of the pool.

**How the pool is seen.** One layer of the pool is ``[NB, 2, Hkv, BS, D]``: every (block,
K/V, head) is a contiguous chunk of ``BS`` rows of ``D``, and consecutive blocks are ``S``
chunks apart (``models.kv_layout.block_chunks``: ``2 * Hkv`` in a layer-major pool, ``layers *
2 * Hkv`` in a block-major one). The memory from the layer's first row on is therefore one
long sequence of chunks with a single head; chunk ``b * S + h`` is head ``h``'s keys of block
``b`` and the chunk ``Hkv`` further on is its values (chunks of other layers lie between the
blocks, and no list names them). Keys are read through the view that starts at the layer's
first row and values through the view that starts ``Hkv`` chunks later, so one chunk index
names a block's keys in one and its values in the other; ``chunk // S`` is its block.

**How the queries are laid out.** One block of ``QB`` query rows per (sequence, KV head): its
``G = Hq / Hkv`` query heads for each of the sequence's new tokens, row ``t * G + g``. Its KV
blocks are that head's chunks of the sequence's blocks; the ones wholly before its first new
token need no mask (``full``), the rest are masked causally by position.

Decodes and verifications only (``G * q <= QB``), without token trees: prompt chunks and trees
keep the gather path. Every sequence of a step that fits goes into one group, whatever its
number of new tokens or its context length: nothing is padded but the query block itself.

**Bucketed steps** (``runtime.bucketed``, on a GPU): ``plan_bucket`` builds the same kind of
mask from the bucket's device buffers with device ops only, so the CUDA graph of the bucket
holds it; a query block is ``G * q`` rows of the bucket's width (at least ``QUERY_BLOCK``).
Buckets over fewer than ``min_context_tokens`` gather, as small ragged groups do.

The kernel is compiled for static shapes (inductor's CPU template does not compile with dynamic
ones), so the number of query blocks is padded to a power of two and every other shape is fixed
by the pool: a model compiles at most one kernel per bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from models.attention.metadata import AttentionSpec, SeqSlice
from models.kv_layout import block_chunks

log = logging.getLogger(__name__)

QUERY_BLOCK = 16  # query rows per (sequence, KV head): G query heads times the new tokens
MAX_QUERY_BLOCKS = 512  # beyond this many (sequence, head) pairs a step takes the gather path
RECOMPILE_LIMIT = 64  # compiled shapes of the kernel (buckets and ragged groups, every model)


def kv_lists(lists: torch.Tensor, padded: int, width: int) -> torch.Tensor:
    """Per query block, the chunks it reads: lists [n, m] (n <= padded) -> [1, 1, padded, width].

    A block mask's KV extent must cover the whole key view (``width`` chunks), while a query
    block lists at most ``m``: the result is rows of ``width`` entries at a stride of ``m`` over
    one buffer of ``padded * m + width`` entries (a row's entries past its count are never
    read), where a dense [padded, width] tensor would be ``width / m`` times larger (hundreds
    of MB for a large pool)."""
    n, m = lists.shape
    store = torch.zeros(padded * m + width, dtype=torch.int32, device=lists.device)
    store[: n * m] = lists.reshape(n * m).to(torch.int32)
    return store.as_strided((1, 1, padded, width), (0, 0, m, 1))


def causal_mask(
    first: torch.Tensor,
    logical: torch.Tensor,
    query_block: int,
    group: int,
    block_size: int,
    stride: int,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The mask_mod of a paged block mask: query row ``q`` (row ``t * G + g`` of its query
    block) sits at position ``first[block] + t``; key row ``kv`` of chunk ``c`` (of pool block
    ``c // stride``) at ``logical[c // stride] * block_size + kv % block_size``; a row sees the
    keys at or before it. first: [P] each query block's first position; logical: [>= NB] each
    pool block's index within the sequence that reads it."""

    def causal(
        _b: torch.Tensor, _h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        pos = first[q // query_block] + (q % query_block) // group
        return logical[kv // (block_size * stride)] * block_size + kv % block_size <= pos

    return causal


@dataclass(frozen=True)
class FlexPlan:
    """A group's block mask over one layer's chunks, shared by every layer of the step."""

    block_mask: BlockMask
    num_query_blocks: int  # b * Hkv, before padding
    group_size: int  # G
    query_block: int = QUERY_BLOCK  # rows per query block (a bucket's may be wider)


def key_chunks(spec: AttentionSpec) -> int:
    """Chunks in the key (and the value) view of a layer: the mask's KV extent."""
    return (spec.num_blocks - 1) * spec.block_chunks + spec.num_kv_heads


class FlexKernel:
    """The compiled kernel of one model and the rule for when a group takes it.

    ``min_context_tokens``: a group whose sequences attend over fewer context tokens than this,
    all together, takes the gather path, where the copy is small and the compiled kernel's fixed
    cost per call is not repaid.
    """

    def __init__(self, min_context_tokens: int = 32768) -> None:
        self.min_context_tokens = min_context_tokens
        self._kernel: Callable[..., torch.Tensor] | None = None
        self._shapes: set[tuple[int, int]] = set()
        self.failed: str | None = None  # why the kernel could not run; then never tried again
        self.fallbacks = 0  # group-layers that took the gather path because it failed

    @staticmethod
    def fits(group_size: int, seq: SeqSlice) -> bool:
        """Whether a sequence's new tokens fit one query block (and are not a tree)."""
        return seq.tree is None and group_size * seq.num_new <= QUERY_BLOCK

    def applies(self, context_tokens: int) -> bool:
        """Whether the sequences that fit, attending over ``context_tokens`` in all, take the
        kernel."""
        return self.failed is None and context_tokens >= self.min_context_tokens

    def plan(
        self,
        tables: torch.Tensor,
        need: torch.Tensor,
        cached: torch.Tensor,
        spec: AttentionSpec,
    ) -> FlexPlan | None:
        """The block mask of a group: tables [b, NBmax] its blocks, need [b] how many each
        attends over, cached [b] its tokens before the new ones. None when the group has more
        (sequence, head) pairs than a compiled kernel serves."""
        b = tables.shape[0]
        h, num_blocks = spec.num_kv_heads, spec.num_blocks
        block_size, device = spec.block_size, spec.device
        nq = b * h
        if nq > MAX_QUERY_BLOCKS:
            return None
        padded = max(4, 1 << (nq - 1).bit_length())  # [P] query blocks, a power of two
        width, stride = key_chunks(spec), spec.block_chunks
        nbmax = tables.shape[1]
        chunks = tables.unsqueeze(1) * stride + torch.arange(h).view(1, h, 1)  # [b, H, NBmax]
        j = torch.arange(nbmax)
        used = j.view(1, -1) < need.view(-1, 1)  # [b, NBmax] attended (the rest is padding)
        full = (j.view(1, -1) + 1) * block_size <= cached.view(-1, 1)  # [b, NBmax] before q
        part = used & ~full  # [b, NBmax] attended, masked
        # Per query block: its masked chunks and its full ones, each left-aligned (the full
        # ones are a prefix of the table, the masked ones the blocks after them).
        n_full = full.sum(1).repeat_interleave(h).int()  # [b * H]
        n_part = part.sum(1).repeat_interleave(h).int()  # [b * H]
        order = torch.argsort((~part).int(), dim=1, stable=True)  # [b, NBmax] masked first
        masked = chunks.gather(2, order.unsqueeze(1).expand(b, h, nbmax)).view(nq, nbmax)
        kv_num = torch.zeros(padded, dtype=torch.int32)
        full_num = torch.zeros(padded, dtype=torch.int32)
        kv_num[:nq], full_num[:nq] = n_part, n_full
        # The logical block of every pool block (a KV row's position for the mask) and each
        # query block's first position.
        logical = torch.zeros(num_blocks, dtype=torch.long)
        logical[tables[used]] = j.view(1, -1).expand(b, nbmax)[used]  # padding is not used
        first = torch.zeros(padded, dtype=torch.long)
        first[:nq] = cached.repeat_interleave(h)
        logical, first = logical.to(device), first.to(device)
        g = spec.group_size
        mask = BlockMask.from_kv_blocks(
            kv_num.view(1, 1, padded).to(device),
            kv_lists(masked.to(device), padded, width),
            full_num.view(1, 1, padded).to(device),
            kv_lists(chunks.view(nq, nbmax).to(device), padded, width),
            BLOCK_SIZE=(QUERY_BLOCK, block_size),
            mask_mod=causal_mask(first, logical, QUERY_BLOCK, g, block_size, stride),
            seq_lengths=(padded * QUERY_BLOCK, width * block_size),
            compute_q_blocks=False,
        )
        return FlexPlan(mask, nq, g)

    def plan_bucket(
        self,
        tables: torch.Tensor,
        cached: torch.Tensor,
        num_new: torch.Tensor,
        query: int,
        spec: AttentionSpec,
    ) -> FlexPlan | None:
        """The block mask of a bucketed step (``runtime.bucketed``), from device tensors with
        device ops only, so that a CUDA graph can hold it: tables [b, nb] (padding: block 0),
        cached and num_new [b] (a padding sequence brings 0 new tokens: its rows see nothing
        and come out 0). ``query`` is the bucket's rows per sequence; a query block holds
        ``G * query`` rows, at least ``QUERY_BLOCK``. None (the bucket gathers) when the kernel
        failed here before, when the bucket spans fewer than ``min_context_tokens`` (its
        ``b * nb`` blocks: a bucket's choice is fixed, so a CUDA graph holds one path), or
        when it has more (sequence, head) pairs than the kernel serves.

        The blocks a sequence attends over are a prefix of its table: the ones wholly before
        its first new token need no mask (``full``), the rest (``part``) follow them, so each
        query block's KV lists are its table's chunks from 0 and from the first partial one."""
        if self.failed is not None:
            self.fallbacks += 1
            return None
        b, nb = tables.shape
        block_size = spec.block_size
        if b * spec.num_kv_heads > MAX_QUERY_BLOCKS or not self.applies(b * nb * block_size):
            return None
        try:
            h, g = spec.num_kv_heads, spec.group_size
            nq = b * h
            qb = max(QUERY_BLOCK, 1 << (g * query - 1).bit_length())  # rows per query block
            padded = max(4, 1 << (nq - 1).bit_length())  # [P] query blocks
            width, stride = key_chunks(spec), spec.block_chunks
            dev = tables.device
            heads = torch.arange(h, device=dev)
            chunks = tables.unsqueeze(1) * stride + heads.view(1, h, 1)  # [b, H, nb]
            need = (cached + num_new + block_size - 1) // block_size  # [b] blocks attended
            n_full = torch.minimum(cached // block_size, need)  # [b] blocks wholly before q
            j = torch.arange(nb, device=dev)
            first_part = (n_full.view(b, 1) + j.view(1, nb)).clamp(max=nb - 1)  # [b, nb]
            masked = chunks.gather(2, first_part.unsqueeze(1).expand(b, h, nb))  # [b, H, nb]

            def per_block(x: torch.Tensor) -> torch.Tensor:  # [b] -> [P], padding blocks 0
                out = torch.zeros(padded, dtype=torch.int32, device=dev)
                out[:nq] = x.view(b, 1).expand(b, h).reshape(nq).to(torch.int32)
                return out

            # The logical block of every pool block the bucket attends over (its keys' positions
            # for the mask); blocks past a sequence's need write to a spare entry, not a used one.
            used = j.view(1, nb) < need.view(b, 1)  # [b, nb]
            spare = spec.num_blocks
            target = torch.where(used, tables, spare).reshape(-1)  # [b * nb]
            logical = torch.zeros(spare + 1, dtype=torch.long, device=dev)
            logical.scatter_(0, target, j.view(1, nb).expand(b, nb).reshape(-1))
            first = torch.zeros(padded, dtype=torch.long, device=dev)
            first[:nq] = cached.view(b, 1).expand(b, h).reshape(nq)

            mask = BlockMask.from_kv_blocks(
                per_block(need - n_full).view(1, 1, padded),
                kv_lists(masked.view(nq, nb), padded, width),
                per_block(n_full).view(1, 1, padded),
                kv_lists(chunks.view(nq, nb), padded, width),
                BLOCK_SIZE=(qb, block_size),
                mask_mod=causal_mask(first, logical, qb, g, block_size, stride),
                seq_lengths=(padded * qb, width * block_size),
                compute_q_blocks=False,
            )
            return FlexPlan(mask, nq, g, qb)
        except Exception as e:  # an API this torch lacks, say: the bucket gathers
            self.failed = f"{type(e).__name__}: {e}"[:500]
            self.fallbacks += 1
            log.error("paged flex attention cannot plan a bucket, using the gather path: %s", e)
            return None

    def attend(
        self, q: torch.Tensor, layer_kv: torch.Tensor, fg: FlexPlan, scale: float
    ) -> torch.Tensor | None:
        """q: [b, q, Hq, D] (padded per sequence); layer_kv: [NB, 2, Hkv, BS, D], the blocks
        ``block_chunks`` of the plan's pool apart.
        Returns [b, q, Hq, D]; None when the kernel cannot run here (logged once, counted):
        the caller takes the gather path."""
        if self.failed is not None:
            self.fallbacks += 1
            return None
        b, qn, hq, d = q.shape
        nb, _two, h, bs, _d = layer_kv.shape
        g = fg.group_size
        padded = fg.block_mask.kv_num_blocks.shape[-1]
        qb = fg.query_block
        rows = q.new_zeros(padded, qb, d)  # [P, QB, D]
        # [b, q, H, G, D] -> [b, H, q, G, D] -> [b * H, q * G, D]
        rows[: fg.num_query_blocks, : qn * g] = (
            q.view(b, qn, h, g, d).permute(0, 2, 1, 3, 4).reshape(b * h, qn * g, d)
        )
        # the chunks from the layer's first on, as rows: [n, D] from its keys, from its values
        n = ((nb - 1) * block_chunks(layer_kv) + h) * bs
        at = layer_kv.storage_offset()
        keys = layer_kv.as_strided((1, 1, n, d), (0, 0, d, 1), at)
        values = layer_kv.as_strided((1, 1, n, d), (0, 0, d, 1), at + h * bs * d)
        try:
            out = self._run(rows.view(1, 1, padded * qb, d), keys, values, fg, scale)
        except Exception as e:  # e.g. no C++ compiler on the host, or an inductor bug
            self.failed = f"{type(e).__name__}: {e}"[:500]
            self.fallbacks += 1
            log.error("paged flex attention cannot run here, using the gather path: %s", e)
            return None
        out = out.view(padded, qb, d)[: fg.num_query_blocks, : qn * g]
        return out.view(b, h, qn, g, d).permute(0, 2, 1, 3, 4).reshape(b, qn, hq, d)

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fg: FlexPlan, scale: float
    ) -> torch.Tensor:
        if self._kernel is None:
            self._kernel = torch.compile(flex_attention, dynamic=False)
        shape = (q.shape[2], k.shape[2])
        if shape not in self._shapes:  # a new bucket: inductor compiles (seconds, once)
            log.info("compiling paged flex attention for %d query rows, %d KV rows", *shape)
            self._shapes.add(shape)
        # On a GPU the Triton template's tiles must divide the mask's blocks (a KV block is
        # one chunk of ``block_size`` rows; its default tiles are 64 to 128 rows).
        options = {"BLOCK_M": 16, "BLOCK_N": 16} if q.is_cuda else None
        # One compiled kernel per shape (static shapes: the CPU template needs them, and the
        # GPU's were checked so): more shapes than dynamo's default of 8 recompiles, past
        # which it would run an unfused flex_attention that cannot be captured in a graph.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            out: torch.Tensor = self._kernel(
                q, k, v, block_mask=fg.block_mask, scale=scale, kernel_options=options
            )
        return out
