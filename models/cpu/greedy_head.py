"""The exact argmax of an fp32 LM head on a CPU: a bf16 screen of every logit with a certified
error bound, then exact fp32 panels where a logit could still win (docs/cpu-kernels.md, "The
bound"). The exact panels are the full head's bits, so the token is ``logits.argmax(-1)``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from models.cpu.linear import PANEL, PanelKind, PanelWeight, pack_panels

_U = 2.0**-24  # fp32 unit roundoff
_ROUND = 2.0**-8  # bound on a bf16 result's relative error, from its rounded value
_UP = 1.0 + 2.0**-20  # rounds a float64 norm's own error up, and past its fp32 storage


@dataclass
class GreedyHead:
    """``fallbacks``: rows whose screen was not finite, argmaxed over the full head."""

    exact: PanelWeight  # the fp32 head, kind F32: [P, K, 16]
    screen: PanelWeight
    residual: float  # R: max_j |w_j - bf16(w_j)|
    screen_norm: float  # S: max_j |bf16(w_j)|
    exact_norm: float  # W: max_j |w_j|
    dense: torch.Tensor | None = None  # oneDNN's screen past ``max_rows`` rows (AMX only)
    # the panel screen halves weight bytes but runs bf16 at half the fp32 rate: few rows only
    max_rows: int = field(default=6)
    screened: int = field(default=0)
    fallbacks: int = field(default=0)

    @classmethod
    def build(cls, weight: torch.Tensor, exact: PanelWeight) -> GreedyHead | None:
        """None where the kernel has no bf16 kind here (the head then stays whole)."""
        if exact.kind is not PanelKind.F32 or exact.kernel.kind_for(torch.bfloat16) is None:
            return None
        if weight.shape[1] % 2:  # the bf16 kind takes pairs
            return None
        low = weight.to(torch.bfloat16)
        w64, v64 = weight.double(), low.double()
        screen = PanelWeight(
            exact.kernel,
            PanelKind.BF16,
            pack_panels(low, PanelKind.BF16),
            None,
            weight.shape[0],
            torch.bfloat16,
        )
        return cls(
            exact,
            screen,
            residual=(w64 - v64).norm(dim=1).max().item() * _UP,
            screen_norm=v64.norm(dim=1).max().item() * _UP,
            exact_norm=w64.norm(dim=1).max().item() * _UP,
            dense=dense_table(low) if amx_tiles() else None,
        )

    def takes(self, rows: int) -> bool:
        return rows <= self.max_rows or self.dense is not None

    def _screen(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] > self.max_rows and self.dense is not None:
            x = hidden.to(torch.bfloat16)
            s: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.dense, None, "none", [], ""
            )
            return s
        return self.screen.matmul(hidden)

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, K] float32 -> [N] int64, each row's ``logits.argmax(-1)`` exactly."""
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.long)
        if n == 0:
            return out
        self.screened += n
        s = self._screen(hidden)
        best = s.amax(dim=1).float()
        finite = torch.isfinite(best)
        if not bool(finite.all()):
            bad = (~finite).nonzero().flatten()
            self.fallbacks += bad.numel()
            out[bad] = self.exact.matmul(hidden[bad]).argmax(dim=-1)
            if bad.numel() == n:
                return out
        rows = finite.nonzero().flatten()
        if rows.numel() < n:
            hidden, s, best = hidden[rows], s[rows], best[rows]
        kernel = self.exact.kernel
        pair_row, panel = kernel.panels_at_least(s, self.threshold(hidden, best))
        x = hidden if hidden.is_contiguous() else hidden.contiguous()
        y = kernel.pairs(x, self.exact.data, pair_row, panel)  # [Q, 16] the exact logits
        if not bool(torch.isfinite(y).all()):  # an fp32 logit overflowed: the head decides
            self.fallbacks += rows.numel()
            out[rows] = self.exact.matmul(hidden).argmax(dim=-1)
            return out
        column = panel[:, None] * PANEL + torch.arange(PANEL)  # [Q, 16] vocabulary ids
        y[column >= self.exact.out_features] = -math.inf
        out[rows] = _first_argmax(y, column, pair_row, rows.numel())
        return out

    def threshold(self, h: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """[n] fp32, rounded down: a row's winner screens at or above it (best: [n] maxima)."""
        k = h.shape[1]
        g = k * _U / (1 - k * _U)
        h64 = h.double()
        hn = h64.norm(dim=1)
        e = (h64 - h.to(torch.bfloat16).double()).norm(dim=1)  # |h - x|, and |x| <= |h| + e
        b = (
            hn * (self.residual + g * self.exact_norm) + (e + g * (hn + e)) * self.screen_norm
        ) * _UP
        # bf16 flushes subnormals: a dropped input < 2^-126 x its factor, a flushed sum < 2^-126
        b += 2.0**-125 * (k + math.sqrt(k) * (self.screen_norm + hn + e))
        m = best.double()
        t = m - 2 * b - _ROUND * m.abs()
        # s >= t / (1 + 2^-8) or t / (1 - 2^-8) by sign: the lower covers both
        low = torch.minimum(t / (1 + _ROUND), t / (1 - _ROUND))
        return (low - low.abs() * 2.0**-22).float()  # float32 rounding cannot raise it


def amx_tiles() -> bool:
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return supported is not None and bool(supported()) and torch.backends.mkldnn.is_available()


def dense_table(low: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(low.contiguous(), 32)
    return packed


def _first_argmax(
    y: torch.Tensor, column: torch.Tensor, pair_row: torch.Tensor, n: int
) -> torch.Tensor:
    """[n] each row's lowest column of its largest value. y, column: [Q, 16]; pair_row: [Q],
    a row's pairs in ascending column order."""
    value = y.amax(dim=1)
    top = torch.full((n,), -math.inf).scatter_reduce(0, pair_row, value, "amax")
    q = torch.arange(value.numel())
    first = torch.where(value == top[pair_row], q, value.numel())
    pick = torch.full((n,), value.numel()).scatter_reduce(0, pair_row, first, "amin")
    lane = y[pick].argmax(dim=1)
    return column[pick, lane]
