"""``flex_attention`` over the pool in place (``flex_plan`` builds its block masks): one
model's compiled kernel, what it may serve, and its failures, per shape and counted."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import flex_attention

from models.attention import flex_plan
from models.attention.flex_plan import QUERY_BLOCK, FlexPlan, key_chunks
from models.attention.metadata import AttentionSpec, SeqSlice
from models.kv_layout import block_chunks

log = logging.getLogger(__name__)

MAX_QUERY_BLOCKS = 16384
RECOMPILE_LIMIT = 64


# Triton's flex templates index K/V rows in int32: a layer's view of a large block-major pool
# (Llama-8B's KV shape: block b at row b * 8,192) passes 2**31 elements from block ~2,048
INT32_ELEMENTS = 2**31 - 1


class FlexKernel:
    """One model's compiled kernel. Short queries (decodes, verifications, small trees) over
    fewer than ``min_context_tokens`` gather, where gathering measured faster on a GPU
    (BENCHMARKS.md, GPU section); so does a CUDA pool whose layer view spans more than
    ``max_view_elements`` (None: any)."""

    def __init__(
        self, min_context_tokens: int = 32768, max_view_elements: int | None = INT32_ELEMENTS
    ) -> None:
        self.min_context_tokens = min_context_tokens
        self.max_view_elements = max_view_elements
        self._kernel: Callable[..., torch.Tensor] | None = None
        self._shapes: set[tuple[int, int]] = set()  # logged since the last reset
        self.compiles = 0  # graphs dynamo compiled for this kernel's calls
        self.failed: str | None = None  # why no step can run in place (planning, capture)
        self.failed_shapes: dict[tuple[int, ...], str] = {}  # a kernel's shape: why it failed
        self.plan_failures: dict[str, int] = {}  # why a step could not be planned: how often
        self.fallbacks = 0
        self.too_large = 0  # steps gathered because the pool's view is past int32 offsets

    @staticmethod
    def short(group_size: int, seq: SeqSlice) -> bool:
        """A decode, verification or small tree: one query block of QUERY_BLOCK rows."""
        return group_size * seq.num_new <= QUERY_BLOCK

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
        self, seqs: Sequence[SeqSlice], tables: torch.Tensor, spec: AttentionSpec, query_block: int
    ) -> FlexPlan | None:
        """A ragged group (``seqs`` over ``tables`` [b, NBmax]) planned on the host; None (its
        sequences gather) after a failure, past MAX_QUERY_BLOCKS or past int32 offsets."""
        if self.failed is not None:
            return None
        tokens = query_block // spec.group_size
        tiles = sum(-(-s.num_new // tokens) for s in seqs)
        if tiles * spec.num_kv_heads > MAX_QUERY_BLOCKS or not self.reachable(spec):
            return None
        return self._planned(lambda: flex_plan.plan_ragged(seqs, tables, spec, query_block))

    def plan_bucket(
        self,
        tables: torch.Tensor,
        cached: torch.Tensor,
        num_new: torch.Tensor,
        query: int,
        spec: AttentionSpec,
    ) -> FlexPlan | None:
        """A bucket's plan with device ops only (CUDA graphs). None (gather) after a failure,
        under ``min_context_tokens``, past MAX_QUERY_BLOCKS or past int32 offsets."""
        if self.failed is not None:
            self.fallbacks += 1
            return None
        b, nb = tables.shape
        if b * spec.num_kv_heads > MAX_QUERY_BLOCKS or not self.applies(b * nb * spec.block_size):
            return None
        if not self.reachable(spec):
            return None
        return self._planned(lambda: flex_plan.plan_bucket(tables, cached, num_new, query, spec))

    def _planned(self, build: Callable[[], FlexPlan]) -> FlexPlan | None:
        """The plan, or None (this step's group gathers, counted; each error logged once)."""
        try:
            return build()
        except Exception as e:
            why = f"{type(e).__name__}: {e}"[:500]
            self.fallbacks += 1
            if why not in self.plan_failures:
                log.error("paged flex attention cannot plan a step, which gathers: %s", why)
            self.plan_failures[why] = self.plan_failures.get(why, 0) + 1
            return None

    def attend(
        self, q: torch.Tensor, layer_kv: torch.Tensor, fg: FlexPlan, scale: float
    ) -> torch.Tensor | None:
        """A bucket's q: [b, q, Hq, D]; layer_kv: [NB, 2, Hkv, BS, D]. Returns [b, q, Hq, D], or
        None when the kernel cannot run here (logged, counted): the caller gathers."""
        b, qn, hq, d = q.shape
        h, g, qb = layer_kv.shape[2], fg.group_size, fg.query_block
        rows = q.new_zeros(fg.padded, qb, d)
        # [b, q, H, G, D] -> [b, H, q, G, D] -> [b * H, q * G, D]
        rows[: fg.num_query_blocks, : qn * g] = (
            q.view(b, qn, h, g, d).permute(0, 2, 1, 3, 4).reshape(b * h, qn * g, d)
        )
        out = self._call(rows.view(fg.padded * qb, d), layer_kv, fg, scale)
        if out is None:
            return None
        out = out.view(fg.padded, qb, d)[: fg.num_query_blocks, : qn * g]
        return out.view(b, h, qn, g, d).permute(0, 2, 1, 3, 4).reshape(b, qn, hq, d)

    def attend_rows(
        self, q: torch.Tensor, layer_kv: torch.Tensor, fg: FlexPlan, scale: float
    ) -> torch.Tensor | None:
        """A ragged group's q: [t, Hq, D] -> [t, Hq * D], or None (the caller gathers)."""
        assert fg.rows is not None
        t, hq, d = q.shape
        rows = q.new_zeros(fg.padded * fg.query_block, d)
        rows[fg.rows] = q.reshape(t * hq, d)
        out = self._call(rows, layer_kv, fg, scale)
        return None if out is None else out[fg.rows].view(t, hq * d)

    def _call(
        self, rows: torch.Tensor, layer_kv: torch.Tensor, fg: FlexPlan, scale: float
    ) -> torch.Tensor | None:
        """rows: [P * query_block, D] -> the same, attended; None after a failure."""
        if self.failed is not None:
            self.fallbacks += 1
            return None
        nb, _two, h, bs, d = layer_kv.shape
        # the layer's chunks as rows [n, D]: keys, and values Hkv chunks later
        n = ((nb - 1) * block_chunks(layer_kv) + h) * bs
        at = layer_kv.storage_offset()
        keys = layer_kv.as_strided((1, 1, n, d), (0, 0, d, 1), at)
        values = layer_kv.as_strided((1, 1, n, d), (0, 0, d, 1), at + h * bs * d)
        # what a compiled kernel is specialised on: the rows, and the mask's lengths
        shape = (rows.shape[0], n, *fg.block_mask.seq_lengths)
        if shape in self.failed_shapes:
            self.fallbacks += 1
            return None
        try:
            out = self._run(rows.view(1, 1, *rows.shape), keys, values, fg, scale)
        except Exception as e:  # this shape gathers from now on; the others still try
            self.failed_shapes[shape] = f"{type(e).__name__}: {e}"[:500]
            self.fallbacks += 1
            # a valid call after a failed one returned wrong values (0.27 off, torch 2.13
            # CPU) until dynamo's compiled state was dropped: every compile starts afresh
            torch._dynamo.reset()
            self._kernel = None
            self._shapes.clear()
            log.error(
                "paged flex attention failed for %d query rows over %d KV rows, which gather "
                "from now on (compiled kernels reset): %s",
                shape[0],
                shape[1],
                e,
            )
            return None
        return out.view(rows.shape)

    def _run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fg: FlexPlan, scale: float
    ) -> torch.Tensor:
        if self._kernel is None:
            self._kernel = torch.compile(flex_attention, dynamic=False)
        shape = (q.shape[2], k.shape[2])
        if shape not in self._shapes:
            log.info("compiling paged flex attention for %d query rows, %d KV rows", *shape)
            self._shapes.add(shape)
        graphs = counters["stats"]["unique_graphs"]
        # the Triton template's tiles must divide the mask's blocks (default 64-128 rows)
        options = {"BLOCK_M": 16, "BLOCK_N": 16} if q.is_cuda else None
        # past dynamo's default 8 recompiles it would run flex unfused, which graphs can't hold
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            out: torch.Tensor = self._kernel(
                q, k, v, block_mask=fg.block_mask, scale=scale, kernel_options=options
            )
        # dynamo's own count: a mask's shape or function compiles anew as well as q's and k's
        self.compiles += counters["stats"]["unique_graphs"] - graphs
        return out
