"""RMSNorm, rotary embedding and SiLU-gated product on a CPU, one C call each
(``csrc/row_ops.c``), rounding as the PyTorch ops of ``models.layers.RowOps`` do, which run where
the kernel cannot be built. The layer program calls the same functions."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch

from models.cpu import native
from models.layers import RowOps

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "row_ops.c"
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",  # products and sums round as PyTorch's separate ops do
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class CpuRowOps(RowOps):
    """The kernel, loaded on first use; ``failed``: why it could not be."""

    def __init__(self) -> None:
        self._norm: Callable[..., int] | None = None
        self._rope: Callable[..., int] | None = None
        self._silu_mul: Callable[..., int] | None = None
        self.lib: ctypes.CDLL | None = None
        self.failed: str | None = None

    def ready(self) -> bool:
        if self._norm is None and self.failed is None:
            try:
                lib = ctypes.CDLL(str(native.build_library(SOURCE, FLAGS)))
                p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
                norm, rope, silu_mul = lib.tandem_rms_norm, lib.tandem_rope, lib.tandem_silu_mul
                norm.restype = rope.restype = silu_mul.restype = i32
                norm.argtypes = [i32, p, i64, p, p, i64, i64, i64, ctypes.c_float]
                rope.argtypes = [i32, p, i64, p, p, p, i64, i64, i64]
                silu_mul.argtypes = [i32, p, i64, p, i64, i64, i64]
                lib.tandem_add.restype = i32
                self._norm, self._rope, self._silu_mul, self.lib = norm, rope, silu_mul, lib
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"[:500]
                log.error("the CPU row-ops kernel is unavailable, using PyTorch ops: %s", e)
        return self._norm is not None

    def takes(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in DTYPES and x.stride(-1) == 1 and self.ready()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() != 2 or not self.takes(x):
            return super().rms_norm(x, weight, eps)
        assert self._norm is not None
        t, h = x.shape
        y = x.new_empty(t, h)
        code = DTYPES[x.dtype]
        self._norm(code, x.data_ptr(), x.stride(0), weight.data_ptr(), y.data_ptr(), h, t, h, eps)
        return y

    def rope(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.stride(1) != x.shape[2] or not self.takes(x):
            return super().rope(cos, sin, x)
        assert self._rope is not None
        t, heads, d = x.shape
        cos, sin = cos.contiguous(), sin.contiguous()
        y = x.new_empty(t, heads, d)
        self._rope(
            DTYPES[x.dtype],
            x.data_ptr(),
            x.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            y.data_ptr(),
            t,
            heads,
            d,
        )
        return y

    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        if not self.takes(gate_up):
            return super().silu_mul(gate_up, inter)
        assert self._silu_mul is not None
        t = gate_up.shape[0]
        y = gate_up.new_empty(t, inter)
        code = DTYPES[gate_up.dtype]
        self._silu_mul(code, gate_up.data_ptr(), gate_up.stride(0), y.data_ptr(), inter, t, inter)
        return y
