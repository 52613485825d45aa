"""The panel kernel's fallback: weights reordered for oneDNN's matmul in column chunks, since
oneDNN blocks a long reduction differently for one row than for several. The chunk widths that
reduce every row alike are probed per dtype and shape (``RowInvariance``), not assumed."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import pairwise

import torch

log = logging.getLogger(__name__)

_PROBE_ROWS = (*range(1, 18), 24, 32, 33, 48, 64, 96, 128, 160, 256, 512)
_PROBE_REFERENCE_ROWS = 32
# the blocking depends on the output width too, so the probe uses the real one, up to this
_PROBE_MAX_OUT = 4096
_CHUNKS = (1024, 512, 256, 128, 64)


@dataclass(frozen=True)
class PackedWeight:
    chunks: tuple[torch.Tensor, ...]
    bounds: tuple[int, ...]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out]; the chunks' products summed left to right."""
        if len(self.chunks) == 1:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.chunks[0], bias, "none", [], ""
            )
            return out
        y: torch.Tensor | None = None
        for (a, b), chunk in zip(pairwise(self.bounds), self.chunks, strict=True):
            part: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x[:, a:b], chunk, None, "none", [], ""
            )
            y = part if y is None else y.add_(part)
        assert y is not None
        return y if bias is None else y.add_(bias)


def _reorder(w: torch.Tensor) -> torch.Tensor:
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 8)
    return packed


def _chunked(w: torch.Tensor, width: int) -> PackedWeight:
    bounds = (*range(0, w.shape[1], width), w.shape[1])
    return PackedWeight(tuple(_reorder(w[:, a:b]) for a, b in pairwise(bounds)), bounds)


def _row_invariant(dtype: torch.dtype, in_features: int, out: int, width: int) -> bool:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out, in_features, generator=g) * 0.05).to(dtype)
    x = torch.randn(max(_PROBE_ROWS), in_features, generator=g).to(dtype)
    packed = _chunked(w, width)
    ref = torch.cat([packed.matmul(x[i : i + 1]) for i in range(_PROBE_REFERENCE_ROWS)])
    for m in _PROBE_ROWS:
        rows = min(m, _PROBE_REFERENCE_ROWS)
        if not torch.equal(packed.matmul(x[:m])[:rows], ref[:rows]):
            return False
    return True


@dataclass
class RowInvariance:
    _widths: dict[tuple[torch.dtype, int, int], int] = field(default_factory=dict)

    def chunk_width(self, dtype: torch.dtype, in_features: int, out_features: int) -> int:
        key = (dtype, in_features, min(out_features, _PROBE_MAX_OUT))
        if key not in self._widths:
            self._widths[key] = self._probe(*key)
        return self._widths[key]

    @staticmethod
    def _probe(dtype: torch.dtype, in_features: int, out: int) -> int:
        narrower = [c for c in _CHUNKS if c < in_features]
        for width in (in_features, *narrower):
            if _row_invariant(dtype, in_features, out, width):
                return width
        width = narrower[-1] if narrower else in_features
        log.warning(
            "oneDNN reduces a %s matmul over %d inputs differently by row count at every chunk "
            "width tried; serving it in chunks of %d: greedy speculation may then differ from "
            "plain decoding in rare tokens",
            dtype,
            in_features,
            width,
        )
        return width


def onednn_pack(w: torch.Tensor, invariance: RowInvariance | None = None) -> PackedWeight | None:
    """None where oneDNN has no path (a GPU tensor, no oneDNN, no instructions for the dtype)."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        width = (invariance or RowInvariance()).chunk_width(w.dtype, w.shape[1], w.shape[0])
    except RuntimeError:  # e.g. bf16 on a CPU without AVX-512 BF16
        return None
    return _chunked(w, width)
