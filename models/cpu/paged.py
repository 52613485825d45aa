"""Paged attention on a CPU reading the KV pool in place (``csrc/paged_attention.c``). A row's
bits depend only on its query, position and the keys it sees, so a verified or tree token gets
its one-token decode's bits at the model's dtype (docs/cpu-kernels.md)."""

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
MAX_ROWS = MAX_ACCUMULATOR // 16
MAX_BLOCK_SIZE = 256
MAX_HEAD_DIM = 512
MAX_BLOCK_FLOATS = 16384  # block_size * head_dim: one block of one head, converted from bf16
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class NativeGroup:
    kernel: CpuPagedAttention
    rows: torch.Tensor | None
    tables: torch.Tensor
    q_start: torch.Tensor  # [b] int32, each sequence's first row among the group's t
    q_len: torch.Tensor  # [b] int32 (0: a bucket's padding)
    cached: torch.Tensor
    tree_base: torch.Tensor  # [b] int32, first slot of the sequence's token tree; -1: none
    tree_mask: torch.Tensor  # [t, W] uint8, the tree slots each row sees (W = 1 without trees)
    window: int
    bucket: bool = False  # a bucket's rows: padding rows come out 0

    def attend(self, q: torch.Tensor, layer_kv: torch.Tensor, scale: float) -> torch.Tensor:
        out = q.new_zeros(q.shape[0], q.shape[1] * q.shape[2]) if self.bucket else None
        return self.kernel.attend(q, layer_kv, self, scale, out)


def build_library() -> Path:
    return native.build_library(SOURCE, FLAGS)


class CpuPagedAttention:
    """``failed``: why the kernel could not be loaded (never retried); ``max_new_tokens``: longer
    runs gather (None: no limit; tests set one to keep the gather path beside the kernel)."""

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
        if self.failed is not None:
            return f"gather (cpu_paged unavailable: {self.failed})"
        return "cpu_paged" if self._fn is not None else "cpu_paged (not built yet)"

    def ready(self) -> bool:
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
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"[:500]
                log.error("the CPU paged-attention kernel is unavailable, gathering: %s", e)
        return self._fn is not None

    def functions(self) -> tuple[Callable[..., int], Callable[..., int]]:
        assert self._fn is not None and self._write is not None, "ready() first"
        return self._fn, self._write

    def fits(self, block_size: int, seq: SeqSlice) -> bool:
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
        """tables [b, NBmax]; rows [t] the group's tokens in the step (None: all, in order)."""
        q_len = [s.num_new for s in seqs]
        q_start = list(itertools.accumulate(q_len, initial=0))
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
        """tables [b, nb]; cached, num_new [b] (0: padding); sequence i starts at i * max_query."""
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
        """``layer_kv[blocks, :, :, offsets] = stack((k, v), 1)`` in one call; k, v: [T, Hkv, D],
        blocks, offsets: [T] int64. False, writing nothing, for tensors it does not take."""
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
        """q: [t, Hq, D]; layer_kv: [NB, 2, Hkv, BS, D] in slabs, q's dtype. Returns [t, Hq * D]:
        ``out`` when given, its rows no sequence owns left as they are."""
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
            out = q.new_empty(t, hq * d)
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
        if rc != 0:
            raise ValueError(f"CPU paged attention refused the shapes (code {rc})")
        self.calls += 1
        return out
