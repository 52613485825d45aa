"""The exact argmax of an fp32 LM head on a CPU at half its cost: a bf16 screen, then the
exact logits of the few tokens that could still win.

A greedy row needs one thing from the vocabulary projection: its argmax. The full fp32
projection is the largest matmul of a small model's step (every row times the whole
``[V, hidden]`` table). The panel kernel multiplies bf16 by the CPU's bf16 dot-product
instruction at twice the fp32 rate and streams half the bytes, so the screen computes every
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
satisfies ``s + B + 2^-8 |s| >= m - B - 2^-8 |m|``, which the threshold of ``_threshold``
turns into one comparison per logit. A row whose screen holds a NaN or an infinity takes the
full head (counted in ``fallbacks``).

TP > 1 shards the vocabulary over ranks whose logits are gathered collectively; there the
head stays whole (``VocabParallelEmbedding`` builds a screen for one rank only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from models.cpu_linear import PANEL, PanelKind, PanelWeight, pack_panels

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
        )

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, K] float32 -> [N] int64, each row's ``logits.argmax(-1)`` exactly."""
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.long)
        if n == 0:
            return out
        self.screened += n
        s = self.screen.matmul(hidden)  # [N, V] bf16
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
        cand = s >= self._threshold(hidden, best)[:, None]  # [n_ok, V]
        panels = torch.unique(cand.nonzero()[:, 1] // PANEL)  # [U] sorted: ties keep order
        exact = self._panels_times(hidden, panels)  # [n_ok, U * 16]
        out[rows] = self._columns(panels)[exact.argmax(dim=-1)]
        return out

    def _threshold(self, h: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        """[n] bf16: the screened logit at or above which a token may be a row's
        winner (h: [n, K], best: [n] the rows' screened maxima), rounded down into bf16."""
        k = h.shape[1]
        g = k * _U / (1 - k * _U)
        h64 = h.double()
        x64 = h.to(torch.bfloat16).double()
        hn, xn = h64.norm(dim=1), x64.norm(dim=1)
        b = (
            hn * self.residual
            + (h64 - x64).norm(dim=1) * self.screen_norm
            + g * (hn * self.exact_norm + xn * self.screen_norm)
        ) * _UP + k * 2.0**-120  # what flushed subnormal products could lose
        m = best.double()
        t = m - 2 * b - _ROUND * m.abs()
        # s + 2^-8 |s| >= t holds for s >= t / (1 + 2^-8) where s >= 0, t / (1 - 2^-8) where
        # s < 0: the lower of the two covers both.
        low = torch.minimum(t / (1 + _ROUND), t / (1 - _ROUND))
        # rounding to bf16 moves a value by at most 2^-8 of it: lowered first, it stays below
        return (low - low.abs() * 2.0**-7).to(torch.bfloat16)

    def _panels_times(self, h: torch.Tensor, panels: torch.Tensor) -> torch.Tensor:
        """[n, U * 16] the exact fp32 logits of the columns in ``panels`` (the same kernel on
        those panels alone: each output's bits depend on its row and column only)."""
        sub = self.exact.data.index_select(0, panels)  # [U, K, 16]
        y = h.new_empty(h.shape[0], panels.numel() * PANEL)
        self.exact.kernel.run(PanelKind.F32, h.contiguous(), sub, None, y)
        padding = self._columns(panels) >= self.exact.out_features  # the last panel's zeros
        if bool(padding.any()):
            y[:, padding] = -math.inf
        return y

    @staticmethod
    def _columns(panels: torch.Tensor) -> torch.Tensor:
        """[U * 16] the vocabulary ids of ``panels``' columns, in order."""
        return (panels[:, None] * PANEL + torch.arange(PANEL)).flatten()
