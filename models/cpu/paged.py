"""Paged attention on a CPU that reads the KV pool in place: a small C kernel, built on first use.

The reference gather path copies every context block of every sequence into a
dense tensor per layer, pads it to the group's longest context, and SDPA reads it again: in a
decode step at batch 8 to 32 that is most of the attention's time, and attention is about as
much of the step as the matmuls. No maintained kernel reads a paged cache on a CPU for the
torch this project runs on (IPEX's paged attention stops at torch 2.8; vLLM's and SGLang's CPU
kernels are built into their own wheels against their own torch pins), so this one is written
by hand (``models/csrc/paged_attention.c``): per (sequence, KV head, chunk of new tokens), the
scores of the keys each query row sees, then their softmax weights and the weighted values,
every block read where it lies, in fp32, OpenMP over the triples. Prompt chunks take it too: a
prompt's rows are chunked to what one call's accumulators hold (``max_new_tokens``).

**Batch invariance.** A row's result depends on its query, its position and the keys it sees,
never on what shares the call nor on where its keys sit in blocks, so a token verified among
k + 1 rows, or as a node of a draft tree, gets the bits it gets when decoded alone. Groups that
the gather path would have to run in float64 for that reason (``build_attention_metadata``'s
``exact``: bf16 and quantized models) run here at the model's dtype.

**Build.** The source is compiled on first use for this CPU and cached (``models.cpu.native``);
it links the OpenMP runtime torch has loaded, so its threads are torch's. Where it cannot be
built or loaded (no compiler), the reason is logged once and kept in ``failed``, and every
step takes the gather path, counted in ``fallbacks``.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from models.attention.metadata import SeqSlice
from models.cpu import native
from models.kv_layout import slabs_in_place

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "paged_attention.c"
FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",  # no -fassociative-math: every sum is in the order the source says
    "-fopenmp",
    "-fPIC",
    "-shared",
)
MAX_ACCUMULATOR = 16384  # floats one call of a pair accumulates: G * new tokens * D, at most
MAX_ROWS = MAX_ACCUMULATOR // 16  # query rows per call: the kernel chunks longer sequences
MAX_BLOCK_SIZE = 256
MAX_HEAD_DIM = 512
MAX_BLOCK_FLOATS = 16384  # block_size * head_dim: one block of one head, converted from bf16
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class NativeGroup:
    """Sequences whose attention the kernel computes in one call, shared by every layer of a
    step. Host tensors, laid out as the C function takes them."""

    kernel: CpuPagedAttention
    rows: torch.Tensor | None  # [t] the group's tokens among the step's T; None: all, in order
    tables: torch.Tensor  # [b, NBmax] int32, each sequence's blocks
    q_start: torch.Tensor  # [b] int32, each sequence's first row among the group's t
    q_len: torch.Tensor  # [b] int32, its rows (its new tokens; 0: a bucket's padding)
    cached: torch.Tensor  # [b] int32, tokens before the new ones
    tree_base: torch.Tensor  # [b] int32, first slot of the sequence's token tree; -1: none
    tree_mask: torch.Tensor  # [t, W] uint8, the tree slots each row sees (W = 1 without trees)
    window: int  # sliding window in positions; 0: none
    bucket: bool = False  # a bucket's rows: padding rows come out 0

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        out = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2]) if self.bucket else None
        return self.kernel.attend(q, layer_kv, self, scale, out)


def build_library() -> Path:
    """The compiled kernel for this CPU (``models.native``). Raises when no compiler is found
    or the compile fails."""
    return native.build_library(SOURCE, FLAGS)


class CpuPagedAttention:
    """The kernel of one model (loaded on first use) and the rule for which sequences take it:
    ``group_size`` query heads per KV head, ``head_dim`` per head.

    ``failed``: why it could not be built or loaded (then it is never tried again);
    ``fallbacks``: steps that gathered because of that; ``calls``: the group-layers it served.

    ``max_new_tokens``: the longest run of new tokens a sequence brings to the kernel; longer
    ones gather (None: no limit). The kernel takes a sequence's tokens in chunks its
    accumulators hold and reads the pool once where gathering copies it and reads it again, so
    models set no limit (``bench.paged_attention --prompts`` compares the two); a test sets one
    to exercise the gather path beside the kernel.
    """

    def __init__(self, group_size: int, head_dim: int, max_new_tokens: int | None = None) -> None:
        self.group_size = group_size
        self.head_dim = head_dim
        self.max_new_tokens = max_new_tokens
        self._fn: Callable[..., int] | None = None
        self._write: Callable[..., int] | None = None
        self.failed: str | None = None
        self.fallbacks = 0
        self.calls = 0

    def describe(self) -> str:
        """What runs this model's decode attention, for ``/health``."""
        if self.failed is not None:
            return f"gather (cpu_paged unavailable: {self.failed})"
        return "cpu_paged" if self._fn is not None else "cpu_paged (not built yet)"

    def ready(self) -> bool:
        """Whether the kernel is loaded, loading it on the first call."""
        if self._fn is None and self.failed is None:
            try:
                lib = ctypes.CDLL(str(build_library()))  # ctypes releases the GIL in calls
                fn = lib.tandem_paged_attention
                fn.restype = ctypes.c_int
                p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                fn.argtypes = [p, i64, p, i64, p, i64, p, p, p, p, p, i32, p, i64]
                fn.argtypes += [i32] * 6 + [ctypes.c_float, i32]
                write = lib.tandem_kv_write
                write.restype = i32
                write.argtypes = [p, i64, p, i64, p, i64, i64, p, p, i64, i32, i32, i32, i32]
                self._fn, self._write = fn, write
            except Exception as e:  # no compiler, a failed compile, a library that won't load
                self.failed = f"{type(e).__name__}: {e}"[:500]
                log.error("the CPU paged-attention kernel is unavailable, gathering: %s", e)
        return self._fn is not None

    def functions(self) -> tuple[Callable[..., int], Callable[..., int]]:
        """The loaded C functions, attention and the KV write (``models.cpu.program`` calls
        them from C)."""
        assert self._fn is not None and self._write is not None, "ready() first"
        return self._fn, self._write

    def fits(self, block_size: int, seq: SeqSlice) -> bool:
        """Whether the kernel takes a sequence (decodes, verifications and their trees, prompt
        chunks): its head and block shapes within the kernel's limits, and its new tokens
        within ``max_new_tokens``."""
        return (
            (self.max_new_tokens is None or seq.num_new <= self.max_new_tokens)
            and self.group_size * self.head_dim <= MAX_ACCUMULATOR
            and self.group_size <= MAX_ROWS
            and self.head_dim <= MAX_HEAD_DIM
            and self.head_dim % 16 == 0
            and block_size <= MAX_BLOCK_SIZE
            and block_size * self.head_dim <= MAX_BLOCK_FLOATS
        )

    def plan(
        self,
        seqs: list[SeqSlice],
        tables: torch.Tensor,
        rows: torch.Tensor | None,
        window: int | None,
    ) -> NativeGroup:
        """The group of ``seqs`` (tables [b, NBmax] their blocks; rows [t] their tokens in the
        step, None when they are all of it in order)."""
        # host lists made tensors once: this runs on the host every step
        q_len = [s.num_new for s in seqs]
        q_start = list(itertools.accumulate(q_len, initial=0))  # one more: the step's rows
        trees = [s.tree for s in seqs]
        width = max((tr.size for tr in trees if tr is not None), default=1)
        with_trees = any(tr is not None for tr in trees)
        tree_mask = torch.zeros(q_start[-1] if with_trees else 1, width, dtype=torch.uint8)
        for s, start in zip(seqs, q_start, strict=False):
            tr = s.tree
            if tr is not None:  # [num_new, tree size]: the tree slots each new token sees
                anc = tr.ancestors()[s.num_cached - tr.base :]
                tree_mask[start : start + s.num_new, : tr.size] = anc
        return NativeGroup(
            kernel=self,
            rows=rows,
            tables=tables.to(torch.int32).contiguous(),
            q_start=torch.tensor(q_start[:-1], dtype=torch.int32),
            q_len=torch.tensor(q_len, dtype=torch.int32),
            cached=torch.tensor([s.num_cached for s in seqs], dtype=torch.int32),
            tree_base=torch.tensor(
                [-1 if tr is None else tr.base for tr in trees], dtype=torch.int32
            ),
            tree_mask=tree_mask,
            window=window or 0,
        )

    def plan_bucket(
        self,
        tables: torch.Tensor,
        cached: torch.Tensor,
        num_new: torch.Tensor,
        max_query: int,
        window: int | None,
    ) -> NativeGroup:
        """The group of a bucketed step: tables [b, nb];
        cached, num_new [b] (0: a padding sequence); sequence i's rows start at i * max_query."""
        b = tables.shape[0]
        return NativeGroup(
            kernel=self,
            rows=None,
            tables=tables.to(torch.int32).contiguous(),
            q_start=torch.arange(0, b * max_query, max_query, dtype=torch.int32),
            q_len=num_new.to(torch.int32).contiguous(),
            cached=cached.to(torch.int32).contiguous(),
            tree_base=torch.full((b,), -1, dtype=torch.int32),
            tree_mask=torch.zeros(1, 1, dtype=torch.uint8),
            window=window or 0,
            bucket=True,
        )

    def write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_kv: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
    ) -> bool:
        """Write the step's new keys and values, k, v: [T, Hkv, D] (rows strided, heads
        contiguous), into ``layer_kv`` [NB, 2, Hkv, BS, D] at ``offsets`` [T] of ``blocks`` [T]
        (int64): what ``layer_kv[blocks, :, :, offsets] = stack((k, v), 1)`` does, in one call.
        False, having written nothing, where the tensors are not ones it takes (the caller
        then assigns)."""
        nb, _two, hkv, bs, d = layer_kv.shape
        t = k.shape[0]
        if not v.shape[0] == blocks.shape[0] == offsets.shape[0] == t:
            raise ValueError(f"{t} keys, {v.shape[0]} values, {blocks.shape[0]} slots")
        if (
            self._write is None
            or layer_kv.device.type != "cpu"
            or not slabs_in_place(layer_kv)
            or not k.dtype == v.dtype == layer_kv.dtype
            or blocks.dtype != torch.int64
            or offsets.dtype != torch.int64
            or not blocks.is_contiguous()
            or not offsets.is_contiguous()
            or any(t.stride(2) != 1 or t.stride(1) != d for t in (k, v))
        ):
            return False
        rc = self._write(
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            layer_kv.data_ptr(),
            nb,
            layer_kv.stride(0),
            blocks.data_ptr(),
            offsets.data_ptr(),
            t,
            hkv,
            d,
            bs,
            layer_kv.element_size(),
        )
        if rc != 0:
            raise IndexError(f"a KV slot outside the pool's {nb} blocks of {bs}")
        return True

    def attend(
        self,
        q: torch.Tensor,
        layer_kv: torch.Tensor,
        ng: NativeGroup,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [t, Hq, D] the group's queries; layer_kv: [NB, 2, Hkv, BS, D], each block one
        contiguous slab (``slabs_in_place``), on the CPU, float32 or bfloat16 like q. Returns
        [t, Hq * D]: ``out`` when given, whose rows no sequence owns are left as they are."""
        code = DTYPES.get(q.dtype)
        if self._fn is None or code is None or q.dtype != layer_kv.dtype:
            raise ValueError(f"no CPU paged attention for {q.dtype} queries over {layer_kv.dtype}")
        if q.device.type != "cpu" or not slabs_in_place(layer_kv):
            raise ValueError("CPU paged attention reads a pool of contiguous blocks on the CPU")
        t, hq, d = q.shape
        _nb, _two, hkv, bs, _d = layer_kv.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        if out is None:
            out = q.new_empty(t, hq * d)  # [t, Hq * D]
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            layer_kv.data_ptr(),
            layer_kv.stride(0),
            ng.tables.data_ptr(),
            ng.tables.shape[1],
            ng.q_start.data_ptr(),
            ng.q_len.data_ptr(),
            ng.cached.data_ptr(),
            ng.tree_base.data_ptr(),
            ng.tree_mask.data_ptr(),
            ng.tree_mask.shape[1],
            out.data_ptr(),
            out.stride(0),
            ng.cached.shape[0],
            hq,
            hkv,
            d,
            bs,
            ng.window,
            scale,
            code,
        )
        if rc == -3:
            raise MemoryError("CPU paged attention could not allocate its score buffer")
        if rc != 0:  # fits() keeps this from happening: a shape beyond the C limits
            raise ValueError(f"CPU paged attention refused the shapes (code {rc})")
        self.calls += 1
        return out
