"""The exact argmax of an fp32 LM head on a CPU from a bf16 screen of every logit and the
exact logits of the few tokens that could still win.

A greedy row needs one thing from the vocabulary projection: its argmax. The full fp32
projection is the largest matmul of a small model's step (every row times the whole
``[V, hidden]`` table). The panel kernel multiplies bf16 by the CPU's bf16 dot-product
instruction and streams half the bytes (on CPUs whose instruction issues two multiply-adds a
lane at the fp32 rate, it also computes at twice that), so the screen computes every
logit in bf16, bounds how far each can be from the fp32 logit the full head would give, keeps
the tokens whose screened logit is within twice that bound of the row's best, and computes
those exactly with the same fp32 kernel on the 16-column panels that hold them. The kernel
computes each output from its row and its column alone (``models.cpu_linear``), so those
values are bit for bit the full head's, and the token returned is exactly
``logits.argmax(-1)`` (the lowest index among equal maxima). Why by hand: no library ranks
with a certified error bound; approximate top-k kernels give no such guarantee.

**The bound.** For a row ``h`` (fp32) and a table row ``w_j``, with ``x = bf16(h)`` and
``v_j = bf16(w_j)``, the screened logit ``s_j = bf16(fl(x . v_j))`` and the exact one
``y_j = fl(h . w_j)`` (fp32, the multiply-adds in order) satisfy

    |s_j - y_j| <= |h| R + |h - x| S + g (|h| W + |x| S) + 2^-8 |s_j|

where ``R = max_j |w_j - v_j|``, ``S = max_j |v_j|``, ``W = max_j |w_j|`` (Euclidean norms,
computed once in float64 and rounded up), ``g = K u / (1 - K u)`` bounds K fp32 additions
(``u = 2^-24``; products of two bf16 are exact in fp32) and ``2^-8`` the final rounding to
bf16. With ``B`` the part that does not depend on ``j`` and ``m = max_j s_j``, the row's winner
satisfies ``s + B + 2^-8 |s| >= m - B - 2^-8 |m|``, which ``threshold``
turns into one comparison per logit. A row whose screen holds a NaN or an infinity takes the
full head (counted in ``fallbacks``), as do the rows of a call where an exact logit overflowed.
The bf16 instruction also flushes subnormals to zero; the bound adds what that can lose.

**Two screens.** Up to ``max_rows`` rows the panel kernel's bf16 kind screens (it streams
the half-size table once, which is what a few rows cost). Past that, on a CPU with AMX tiles,
oneDNN's bf16 matmul screens (over a copy of the table reordered once for it, ``dense_table``):
its tiles multiply at many times the vector instruction's rate, where the panel kernel's bf16
screen costs a many-row step more than the full fp32 head. The bound above holds for it as
written: its inputs are the same bf16 values, its products are exact in fp32, and it adds
them in fp32 (in some order: ``g`` bounds any order of K additions) with subnormals flushed,
then rounds to bf16. Without AMX a step with more rows takes the full head.

TP > 1 shards the vocabulary over ranks whose logits are gathered collectively; there the
head stays whole (``VocabParallelEmbedding`` builds a screen for one rank only).
"""

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
    """``argmax`` of ``exact``'s logits through a bf16 screen (see the module docstring).
    ``screened``: rows asked for; ``fallbacks``: those whose screen was not finite, argmaxed
    over the full head."""

    exact: PanelWeight  # the fp32 head, kind F32: [P, K, 16]
    screen: PanelWeight  # its bf16 copy, kind BF16
    residual: float  # R: max_j |w_j - bf16(w_j)|
    screen_norm: float  # S: max_j |bf16(w_j)|
    exact_norm: float  # W: max_j |w_j|
    # ``screen``'s table reordered for oneDNN's matmul (``dense_table``), on CPUs with AMX
    # tiles (else None): the screen of calls of more than ``max_rows`` rows
    dense: torch.Tensor | None = None
    # The most rows the panel kernel's screen takes; a call with more goes to ``dense``, or
    # without it to the full head. Per row the panel screen is a bf16 matmul, which the
    # vector instruction runs at half the fp32 multiply-add rate: what it saves in weight
    # bytes pays at a few rows (a batch-1 decode, a short verification), and a whole decode
    # step gains nothing from it by 8 rows (``bench.greedy_head --batch``).
    max_rows: int = field(default=6)
    screened: int = field(default=0)
    fallbacks: int = field(default=0)

    @classmethod
    def build(cls, weight: torch.Tensor, exact: PanelWeight) -> GreedyHead | None:
        """A screen for ``exact`` (the fp32 panels of ``weight`` [V, K]), or None where the
        kernel has no bf16 kind here (the head then stays whole)."""
        if exact.kind is not PanelKind.F32 or exact.kernel.kind_for(torch.bfloat16) is None:
            return None
        if weight.shape[1] % 2:  # the bf16 kind takes pairs
            return None
        low = weight.to(torch.bfloat16)  # [V, K]
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
        """Whether a call of ``rows`` rows is screened (else the caller takes the full head)."""
        return rows <= self.max_rows or self.dense is not None

    def _screen(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, K] float32 -> [N, V] bf16, every screened logit."""
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
        s = self._screen(hidden)  # [N, V] bf16
        best = s.amax(dim=1).float()  # [N]
        finite = torch.isfinite(best)
        if not bool(finite.all()):
            bad = (~finite).nonzero().flatten()
            self.fallbacks += bad.numel()
            out[bad] = self.exact.matmul(hidden[bad]).argmax(dim=-1)
            if bad.numel() == n:
                return out
        rows = finite.nonzero().flatten()  # [n_ok]
        if rows.numel() < n:
            hidden, s, best = hidden[rows], s[rows], best[rows]
        kernel = self.exact.kernel
        pair_row, panel = kernel.panels_at_least(s, self.threshold(hidden, best))  # [Q] each
        x = hidden if hidden.is_contiguous() else hidden.contiguous()
        y = kernel.pairs(x, self.exact.data, pair_row, panel)  # [Q, 16] the exact logits
        if not bool(torch.isfinite(y).all()):  # an fp32 logit overflowed: the head decides
            self.fallbacks += rows.numel()
            out[rows] = self.exact.matmul(hidden).argmax(dim=-1)
            return out
        column = panel[:, None] * PANEL + torch.arange(PANEL)  # [Q, 16] vocabulary ids
        y[column >= self.exact.out_features] = -math.inf  # the last panel's padding
        out[rows] = _first_argmax(y, column, pair_row, rows.numel())
        return out

    def threshold(self, h: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """[n] float32: the screened logit at or above which a token may be a row's winner
        (h: [n, K], best: [n] the rows' screened maxima), rounded down."""
        k = h.shape[1]
        g = k * _U / (1 - k * _U)
        h64 = h.double()
        hn = h64.norm(dim=1)
        e = (h64 - h.to(torch.bfloat16).double()).norm(dim=1)  # |h - x|, and |x| <= |h| + e
        b = (
            hn * (self.residual + g * self.exact_norm) + (e + g * (hn + e)) * self.screen_norm
        ) * _UP
        # the bf16 instruction flushes subnormal inputs and sums to zero: each input it drops
        # is below 2^-126 times the other factor, each sum it flushes below 2^-126
        b += 2.0**-125 * (k + math.sqrt(k) * (self.screen_norm + hn + e))
        m = best.double()
        t = m - 2 * b - _ROUND * m.abs()
        # s + 2^-8 |s| >= t holds for s >= t / (1 + 2^-8) where s >= 0, t / (1 - 2^-8) where
        # s < 0: the lower of the two covers both.
        low = torch.minimum(t / (1 + _ROUND), t / (1 - _ROUND))
        return (low - low.abs() * 2.0**-22).float()  # float32 rounding cannot raise it


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (oneDNN's bf16 matmul then runs on them) and this torch
    has oneDNN."""
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return supported is not None and bool(supported()) and torch.backends.mkldnn.is_available()


def dense_table(low: torch.Tensor) -> torch.Tensor:
    """low [V, K] bf16 -> the same table reordered once for oneDNN's matmul (sized for a
    decode step's rows): a plain ``F.linear`` reorders it on every call, which costs more than
    the multiplication."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(low.contiguous(), 32)
    return packed


def _first_argmax(
    y: torch.Tensor, column: torch.Tensor, pair_row: torch.Tensor, n: int
) -> torch.Tensor:
    """[n] per row, the column of its largest value among its pairs, the lowest column among
    equal ones (``argmax``'s rule). y, column: [Q, 16]; pair_row: [Q] each pair's row, the
    pairs of a row in ascending column order."""
    value = y.amax(dim=1)  # [Q]
    top = torch.full((n,), -math.inf).scatter_reduce(0, pair_row, value, "amax")  # [n]
    q = torch.arange(value.numel())
    first = torch.where(value == top[pair_row], q, value.numel())  # [Q]
    pick = torch.full((n,), value.numel()).scatter_reduce(0, pair_row, first, "amin")  # [n]
    lane = y[pick].argmax(dim=1)  # the lowest lane among equal values
    return column[pick, lane]
