"""``flex_attention`` reading the pool in place through a block mask (decodes, verifications).
A layer [NB, 2, Hkv, BS, D] is seen as one run of BS-row chunks: chunk ``b * S + h`` (S =
``block_chunks``) is head h's keys of block b; the values view starts Hkv chunks later. A query
block is one (sequence, KV head), row ``t * G + g``; KV blocks wholly before its first new token
are ``full`` (unmasked). Shapes are static (inductor's CPU template needs them)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from models.attention.metadata import AttentionSpec, SeqSlice
from models.kv_layout import block_chunks

log = logging.getLogger(__name__)

QUERY_BLOCK = 16  # query rows per (sequence, KV head)
MAX_QUERY_BLOCKS = 512
RECOMPILE_LIMIT = 64


def kv_lists(lists: torch.Tensor, padded: int, width: int) -> torch.Tensor:
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
    """first: [P] each query block's first position; logical: [>= NB] each pool block's index
    in the sequence that reads it. A row sees the keys at or before its position."""

    def causal(
        _b: torch.Tensor, _h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        pos = first[q // query_block] + (q % query_block) // group
        return logical[kv // (block_size * stride)] * block_size + kv % block_size <= pos

    return causal


@dataclass(frozen=True)
class FlexPlan:
    block_mask: BlockMask
    num_query_blocks: int  # b * Hkv, before padding
    group_size: int
    query_block: int = QUERY_BLOCK


def key_chunks(spec: AttentionSpec) -> int:
    return (spec.num_blocks - 1) * spec.block_chunks + spec.num_kv_heads


# Triton's flex templates index K/V rows in int32: a layer's view of a large block-major pool
# (Llama-8B's KV shape: block b at row b * 8,192) passes 2**31 elements from block ~2,048
INT32_ELEMENTS = 2**31 - 1


class FlexKernel:
    """One model's compiled kernel; groups over fewer than ``min_context_tokens`` gather, and
    so does a CUDA pool whose layer view spans more than ``max_view_elements`` (None: any)."""

    def __init__(
        self, min_context_tokens: int = 32768, max_view_elements: int | None = INT32_ELEMENTS
    ) -> None:
        self.min_context_tokens = min_context_tokens
        self.max_view_elements = max_view_elements
        self._kernel: Callable[..., torch.Tensor] | None = None
        self._shapes: set[tuple[int, int]] = set()
        self.failed: str | None = None  # why no step can run in place (planning, capture)
        self.failed_shapes: dict[tuple[int, ...], str] = {}  # a kernel's shape: why it failed
        self.fallbacks = 0
        self.too_large = 0  # steps gathered because the pool's view is past int32 offsets

    @staticmethod
    def fits(group_size: int, seq: SeqSlice) -> bool:
        return seq.tree is None and group_size * seq.num_new <= QUERY_BLOCK

    def applies(self, context_tokens: int) -> bool:
        return self.failed is None and context_tokens >= self.min_context_tokens

    def reachable(self, spec: AttentionSpec) -> bool:
        """Whether every K/V row of ``spec``'s layer view has an int32 offset where it must."""
        span = key_chunks(spec) * spec.block_size * spec.head_dim
        if spec.device.type != "cuda" or self.max_view_elements is None:
            return True
        if span <= self.max_view_elements:
            return True
        if not self.too_large:
            log.error(
                "a layer's view of this KV pool spans %d elements, past the %d flex indexes: "
                "its steps gather (counted in attention_fallbacks)",
                span,
                self.max_view_elements,
            )
        self.too_large += 1
        self.fallbacks += 1
        return False

    def plan(
        self,
        tables: torch.Tensor,
        need: torch.Tensor,
        cached: torch.Tensor,
        spec: AttentionSpec,
    ) -> FlexPlan | None:
        """tables [b, NBmax], need [b] blocks attended, cached [b]; None past MAX_QUERY_BLOCKS."""
        b = tables.shape[0]
        h, num_blocks = spec.num_kv_heads, spec.num_blocks
        block_size, device = spec.block_size, spec.device
        nq = b * h
        if nq > MAX_QUERY_BLOCKS or not self.reachable(spec):
            return None
        padded = max(4, 1 << (nq - 1).bit_length())
        width, stride = key_chunks(spec), spec.block_chunks
        nbmax = tables.shape[1]
        chunks = tables.unsqueeze(1) * stride + torch.arange(h).view(1, h, 1)
        j = torch.arange(nbmax)
        used = j.view(1, -1) < need.view(-1, 1)  # [b, NBmax] attended (the rest is padding)
        full = (j.view(1, -1) + 1) * block_size <= cached.view(-1, 1)  # [b, NBmax] before q
        part = used & ~full
        # per query block: masked chunks and full ones (a prefix of the table), left-aligned
        n_full = full.sum(1).repeat_interleave(h).int()
        n_part = part.sum(1).repeat_interleave(h).int()
        order = torch.argsort((~part).int(), dim=1, stable=True)
        masked = chunks.gather(2, order.unsqueeze(1).expand(b, h, nbmax)).view(nq, nbmax)
        kv_num = torch.zeros(padded, dtype=torch.int32)
        full_num = torch.zeros(padded, dtype=torch.int32)
        kv_num[:nq], full_num[:nq] = n_part, n_full
        logical = torch.zeros(num_blocks, dtype=torch.long)
        logical[tables[used]] = j.view(1, -1).expand(b, nbmax)[used]
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
        """``plan`` with device ops only (CUDA graphs); padding sequences bring 0 new tokens.
        None (gather) after a failure, under ``min_context_tokens``, or past MAX_QUERY_BLOCKS."""
        if self.failed is not None:
            self.fallbacks += 1
            return None
        b, nb = tables.shape
        block_size = spec.block_size
        if b * spec.num_kv_heads > MAX_QUERY_BLOCKS or not self.applies(b * nb * block_size):
            return None
        if not self.reachable(spec):
            return None
        try:
            h, g = spec.num_kv_heads, spec.group_size
            nq = b * h
            qb = max(QUERY_BLOCK, 1 << (g * query - 1).bit_length())
            padded = max(4, 1 << (nq - 1).bit_length())
            width, stride = key_chunks(spec), spec.block_chunks
            dev = tables.device
            heads = torch.arange(h, device=dev)
            chunks = tables.unsqueeze(1) * stride + heads.view(1, h, 1)
            need = (cached + num_new + block_size - 1) // block_size
            n_full = torch.minimum(cached // block_size, need)  # [b] blocks wholly before q
            j = torch.arange(nb, device=dev)
            first_part = (n_full.view(b, 1) + j.view(1, nb)).clamp(max=nb - 1)
            masked = chunks.gather(2, first_part.unsqueeze(1).expand(b, h, nb))

            def per_block(x: torch.Tensor) -> torch.Tensor:
                out = torch.zeros(padded, dtype=torch.int32, device=dev)
                out[:nq] = x.view(b, 1).expand(b, h).reshape(nq).to(torch.int32)
                return out

            # blocks past a sequence's need scatter to a spare entry, not a used one
            used = j.view(1, nb) < need.view(b, 1)
            spare = spec.num_blocks
            target = torch.where(used, tables, spare).reshape(-1)
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
        """q: [b, q, Hq, D]; layer_kv: [NB, 2, Hkv, BS, D]. Returns [b, q, Hq, D], or None when
        the kernel cannot run here (logged once, counted): the caller gathers."""
        if self.failed is not None:
            self.fallbacks += 1
            return None
        b, qn, hq, d = q.shape
        nb, _two, h, bs, _d = layer_kv.shape
        g = fg.group_size
        padded = fg.block_mask.kv_num_blocks.shape[-1]
        qb = fg.query_block
        rows = q.new_zeros(padded, qb, d)
        # [b, q, H, G, D] -> [b, H, q, G, D] -> [b * H, q * G, D]
        rows[: fg.num_query_blocks, : qn * g] = (
            q.view(b, qn, h, g, d).permute(0, 2, 1, 3, 4).reshape(b * h, qn * g, d)
        )
        # the layer's chunks as rows [n, D]: keys, and values Hkv chunks later
        n = ((nb - 1) * block_chunks(layer_kv) + h) * bs
        at = layer_kv.storage_offset()
        keys = layer_kv.as_strided((1, 1, n, d), (0, 0, d, 1), at)
        values = layer_kv.as_strided((1, 1, n, d), (0, 0, d, 1), at + h * bs * d)
        # what a compiled kernel is specialised on: the rows, and the mask's lengths
        shape = (padded * qb, n, *fg.block_mask.seq_lengths)
        if shape in self.failed_shapes:
            self.fallbacks += 1
            return None
        try:
            out = self._run(rows.view(1, 1, padded * qb, d), keys, values, fg, scale)
        except Exception as e:  # this shape gathers from now on; the others still try
            self.failed_shapes[shape] = f"{type(e).__name__}: {e}"[:500]
            self.fallbacks += 1
            # a valid call after a failed one returned wrong values (0.27 off, torch 2.13
            # CPU) until dynamo's compiled state was dropped: every compile starts afresh
            torch._dynamo.reset()
            self._kernel = None
            log.error(
                "paged flex attention failed for %d query rows over %d KV rows, which gather "
                "from now on (compiled kernels reset): %s",
                shape[0],
                shape[1],
                e,
            )
            return None
        out = out.view(padded, qb, d)[: fg.num_query_blocks, : qn * g]
        return out.view(b, h, qn, g, d).permute(0, 2, 1, 3, 4).reshape(b, qn, hq, d)

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fg: FlexPlan, scale: float
    ) -> torch.Tensor:
        if self._kernel is None:
            self._kernel = torch.compile(flex_attention, dynamic=False)
        shape = (q.shape[2], k.shape[2])
        if shape not in self._shapes:
            log.info("compiling paged flex attention for %d query rows, %d KV rows", *shape)
            self._shapes.add(shape)
        # the Triton template's tiles must divide the mask's blocks (default 64-128 rows)
        options = {"BLOCK_M": 16, "BLOCK_N": 16} if q.is_cuda else None
        # past dynamo's default 8 recompiles it would run flex unfused, which graphs can't hold
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            out: torch.Tensor = self._kernel(
                q, k, v, block_mask=fg.block_mask, scale=scale, kernel_options=options
            )
        return out
