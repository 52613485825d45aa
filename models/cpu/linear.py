"""Row-invariant CPU matmuls over weights packed once into 16-column panels
(``csrc/panel_linear.c``): a row's bits depend on the row and the weight alone, for any number of
rows. Without the kernel, weights are reordered for oneDNN (``models.cpu.onednn``)."""

from __future__ import annotations

import ctypes
import enum
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from models.cpu import native
from models.cpu.onednn import PackedWeight, RowInvariance, onednn_pack
from models.quant import Quant, QuantizedWeight

log = logging.getLogger(__name__)

SOURCE = native.CSRC / "panel_linear.c"
# no -ffast-math or -fassociative-math: each output's multiply-adds must stay in order
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=fast",  # a * b + c as one FMA, alike at every call site
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
PANEL = 16


class PanelKind(enum.IntEnum):
    F32 = 0  # fp32 x, weights and y
    BF16 = 1  # bf16 x, weights and y, fp32 accumulation
    INT8 = 2  # int8 weights with fp32 per-column scales; fp32 x and y
    INT8_DIGITS = 3  # the same int8 weights multiplied in integers; bf16 x (as 16-bit digits), y


class PanelUse(enum.Enum):
    """When matmuls take the panel kernel: ``auto`` where it has its vector tiles (else oneDNN),
    ``always`` (its tests, and measuring it), ``never``. ``$TANDEM_CPU_PANEL`` sets the default."""

    AUTO = "auto"
    ALWAYS = "always"
    NEVER = "never"

    @classmethod
    def from_env(cls) -> PanelUse:
        return cls(os.environ.get("TANDEM_CPU_PANEL", "auto"))


class CpuLinear:
    def __init__(self) -> None:
        self._fn: Callable[..., int] | None = None
        self._pairs: Callable[..., None] | None = None
        self._side: Callable[..., int] | None = None
        self._at_least: Callable[..., int] | None = None
        self._bf16 = False
        self._digits = False
        self._vector = False
        self.failed: str | None = None

    def ready(self) -> bool:
        if self._fn is None and self.failed is None:
            try:
                lib = ctypes.CDLL(str(native.build_library(SOURCE, FLAGS)))
                fn = lib.tandem_panel_linear
                fn.restype = ctypes.c_int
                p, i64 = ctypes.c_void_p, ctypes.c_int64
                fn.argtypes = [ctypes.c_int, p, i64, p, p, p, i64, i64, i64, i64]
                lib.tandem_panel_bf16.restype = ctypes.c_int
                self._bf16 = bool(lib.tandem_panel_bf16())
                lib.tandem_panel_digits.restype = ctypes.c_int
                self._digits = bool(lib.tandem_panel_digits())
                lib.tandem_panel_vector.restype = ctypes.c_int
                self._vector = bool(lib.tandem_panel_vector())
                if not self._vector:
                    log.warning("no AVX-512F: fp32 and int8 matmuls run in oneDNN, not cpu_panel")
                side = lib.tandem_panel_linear_side
                side.restype = ctypes.c_int
                side.argtypes = [*fn.argtypes, p, i64, i64]
                self._side = side
                pairs = lib.tandem_panel_pairs
                pairs.restype = None
                pairs.argtypes = [p, i64, p, i64, p, p, i64, p]
                self._pairs = pairs
                at_least = lib.tandem_bf16_panels_at_least
                at_least.restype = i64
                at_least.argtypes = [p, i64, i64, i64, p, p, p, i64]
                self._at_least = at_least
                self._fn = fn
            except Exception as e:
                self.failed = f"{type(e).__name__}: {e}"[:500]
                log.error("the CPU panel matmul kernel is unavailable, using oneDNN: %s", e)
        return self._fn is not None

    def vector(self) -> bool:
        """Whether the kernel was built with its vector tiles (AVX-512F); without them it is
        correct but slower than oneDNN, so the packer serves through oneDNN instead."""
        return self.ready() and self._vector

    def function(self) -> Callable[..., int]:
        assert self._fn is not None, "ready() first"
        return self._fn

    def side_function(self) -> Callable[..., int]:
        assert self._side is not None, "ready() first"
        return self._side

    def kind_for(self, dtype: torch.dtype) -> PanelKind | None:
        if not self.ready():
            return None
        if dtype == torch.float32:
            return PanelKind.F32
        if dtype == torch.bfloat16 and self._bf16:
            return PanelKind.BF16
        return None

    def int8_kind(self, dtype: torch.dtype) -> PanelKind | None:
        """By digits in a bf16 model on a CPU with VNNI, else widened; None without the kernel."""
        if not self.ready():
            return None
        if dtype == torch.bfloat16 and self._digits:
            return PanelKind.INT8_DIGITS
        return PanelKind.INT8

    def run(
        self,
        kind: PanelKind,
        x: torch.Tensor,
        data: torch.Tensor,
        scale: torch.Tensor | None,
        y: torch.Tensor,
    ) -> None:
        """y [M, N] = x [M, K] times the packed weight ``data`` (unit stride along K and N)."""
        assert self._fn is not None
        rc = self._fn(
            int(kind),
            x.data_ptr(),
            x.stride(0),
            data.data_ptr(),
            None if scale is None else scale.data_ptr(),
            y.data_ptr(),
            y.stride(0),
            x.shape[0],
            y.shape[1],
            x.shape[1],
        )
        if rc != 0:
            raise ValueError(f"the panel matmul refused kind {kind.name} (code {rc})")

    def pairs(
        self, x: torch.Tensor, data: torch.Tensor, rows: torch.Tensor, panels: torch.Tensor
    ) -> torch.Tensor:
        """[n, 16]: ``x[rows[i]]`` times panel ``panels[i]``, bit for bit what ``run`` gives."""
        assert self._pairs is not None and x.stride(-1) == 1
        assert data.dtype == x.dtype == torch.float32 and data.is_contiguous()
        rows, panels = rows.contiguous(), panels.contiguous()
        y = x.new_empty(rows.numel(), PANEL)
        self._pairs(
            x.data_ptr(),
            x.stride(0),
            data.data_ptr(),
            x.shape[1],
            rows.data_ptr(),
            panels.data_ptr(),
            rows.numel(),
            y.data_ptr(),
        )
        return y

    def panels_at_least(
        self, s: torch.Tensor, low: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """([Q] rows, [Q] panels) of ``s`` [M, V] holding a value >= their row's ``low`` [M]."""
        assert self._at_least is not None and s.dtype == torch.bfloat16 and s.stride(1) == 1
        low = low.float().contiguous()
        m, v = s.shape
        cap = 8 * m
        while True:
            rows = torch.empty(cap, dtype=torch.long)
            panels = torch.empty(cap, dtype=torch.long)
            q = self._at_least(
                s.data_ptr(),
                s.stride(0),
                m,
                v,
                low.data_ptr(),
                rows.data_ptr(),
                panels.data_ptr(),
                cap,
            )
            if q <= cap:
                return rows[:q], panels[:q]
            cap = q


def pack_panels(w: torch.Tensor, kind: PanelKind) -> torch.Tensor:
    """``w`` [N, K] -> [P, K, 16] (fp32, int8), [P, K / 2, 16, 2] (bf16) or [P, K4 / 4, 16, 4]
    uint8 of w + 128 (digits, K4 = K rounded up to 4); P = ceil(N / 16), zero-padded."""
    n, k = w.shape
    panels = -(-n // PANEL)
    if kind is PanelKind.INT8_DIGITS:
        k4 = -(-k // 4) * 4
        shifted = torch.full((panels * PANEL, k4), 128, dtype=torch.uint8)
        shifted[:n, :k] = (w.to(torch.int16) + 128).to(torch.uint8)
        return shifted.view(panels, PANEL, k4 // 4, 4).permute(0, 2, 1, 3).contiguous()
    padded = w.new_zeros(panels * PANEL, k)
    padded[:n] = w
    if kind is PanelKind.BF16:
        return padded.view(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return padded.view(panels, PANEL, k).permute(0, 2, 1).contiguous()


_BF16_ROWS = (PanelKind.BF16, PanelKind.INT8_DIGITS)


@dataclass(frozen=True)
class PanelWeight:
    kernel: CpuLinear
    kind: PanelKind
    data: torch.Tensor
    scale: torch.Tensor | None  # [P * 16] float32 per-column scales (int8), padding 0
    out_features: int
    out_dtype: torch.dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        act = torch.bfloat16 if self.kind in _BF16_ROWS else torch.float32
        if x.dtype != act:
            x = x.to(act)
        if x.stride(-1) != 1:
            x = x.contiguous()
        y = x.new_empty(x.shape[0], self.out_features)
        if x.shape[0]:
            self.kernel.run(self.kind, x, self.data, self.scale, y)
        if y.dtype != self.out_dtype:
            y = y.to(self.out_dtype)
        return y if bias is None else y.add_(bias)


CpuWeight = PanelWeight | PackedWeight


@dataclass
class CpuPacker:
    kernel: CpuLinear = field(default_factory=CpuLinear)
    invariance: RowInvariance = field(default_factory=RowInvariance)
    use: PanelUse = field(default_factory=PanelUse.from_env)
    fallbacks: int = 0

    def panel(self) -> bool:
        if self.use is PanelUse.AUTO:
            return self.kernel.vector()
        return self.use is PanelUse.ALWAYS and self.kernel.ready()

    def pack(self, w: torch.Tensor) -> CpuWeight | None:
        if w.device.type != "cpu":
            return None
        kind = self.kernel.kind_for(w.dtype) if self.panel() else None
        if kind is not None and (kind is not PanelKind.BF16 or w.shape[1] % 2 == 0):
            return PanelWeight(
                self.kernel, kind, pack_panels(w.detach(), kind), None, w.shape[0], w.dtype
            )
        self.fallbacks += 1
        return onednn_pack(w, self.invariance)

    def pack_quantized(self, q: QuantizedWeight) -> PanelWeight | None:
        if q.kind is not Quant.INT8 or q.data.device.type != "cpu" or not self.panel():
            return None
        n = q.data.shape[0]
        scale = torch.zeros(-(-n // PANEL) * PANEL, dtype=torch.float32)
        scale[:n] = q.scale.float()
        kind = self.kernel.int8_kind(q.out_dtype)
        assert kind is not None
        return PanelWeight(self.kernel, kind, pack_panels(q.data, kind), scale, n, q.out_dtype)

    def describe(self) -> str:
        if self.kernel.failed is not None:
            return f"onednn (cpu_panel unavailable: {self.kernel.failed})"
        if self.use is PanelUse.NEVER:
            return "onednn (TANDEM_CPU_PANEL=never)"
        if not self.panel():
            return "onednn (cpu_panel has no vector tiles on this CPU: it needs AVX-512F)"
        if self.fallbacks:
            return f"cpu_panel, onednn for {self.fallbacks} weights"
        return "cpu_panel"
