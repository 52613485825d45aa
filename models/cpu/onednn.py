"""Matmul weights reordered for oneDNN's CPU matmul, computing every row alike whatever the batch.

The CPU's fallback matmul (``models.cpu_linear`` packs weights for its own kernel where a C
compiler is found, and takes this path where none is): at the handful of rows of a decode
step the plain ``F.linear`` (MKL) falls well short of the memory bandwidth, and oneDNN's matmul
over a weight reordered once at load time comes closer to it.

**Row invariance.** Greedy speculation is token-identical to plain decoding only if verifying
k + 1 tokens gives each row what a one-token decode gives it, bit for bit, and a decode row
must not change with what else shares its step. oneDNN's matmul does not promise that: over a
long reduction (on AVX-512 CPUs, more than 1,024 input features) it blocks the
reduction one way for a single row and another way for several, so the same row comes out a
few ulps apart. In float32 that rarely moves an argmax; a bf16 model rounds it into other
tokens. So a weight whose reduction is long is reordered in column chunks that are each
reduced alike for any number of rows, and the chunks' partial products are added in a fixed
order. Which widths are safe is oneDNN's choice and the CPU's, so the exact chunking is probed
(``RowInvariance``) once per dtype and shape rather than assumed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import pairwise

import torch

log = logging.getLogger(__name__)

# Row counts the probe compares with one-row matmuls: every count up to 17, then the sizes a
# step of verifications or a prompt chunk reaches.
_PROBE_ROWS = (*range(1, 18), 24, 32, 33, 48, 64, 96, 128, 160, 256, 512)
_PROBE_REFERENCE_ROWS = 32  # rows whose one-row results are the reference
# The blocking depends on the output width too (bf16 over 1,536 inputs: alike at 128 outputs,
# not at 576), so the probe's weight has the real one, up to this many.
_PROBE_MAX_OUT = 4096
_CHUNKS = (1024, 512, 256, 128, 64)  # the widths tried, widest first, after the whole


@dataclass(frozen=True)
class PackedWeight:
    """A weight [out, in] reordered for oneDNN, as column chunks ``in[bounds[i]:bounds[i+1]]``
    (one chunk where the whole reduction is row-invariant)."""

    chunks: tuple[torch.Tensor, ...]  # each a oneDNN reordering of weight[:, a:b]
    bounds: tuple[int, ...]  # (0, ..., in)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out], ``x @ weight^T (+ bias)``; the chunks' products summed
        left to right."""
        if len(self.chunks) == 1:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.chunks[0], bias, "none", [], ""
            )
            return out
        y: torch.Tensor | None = None
        for (a, b), chunk in zip(pairwise(self.bounds), self.chunks, strict=True):
            part: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x[:, a:b], chunk, None, "none", [], ""
            )  # [T, out]
            y = part if y is None else y.add_(part)
        assert y is not None
        return y if bias is None else y.add_(bias)


def _reorder(w: torch.Tensor) -> torch.Tensor:
    # The batch-size hint (8) only tunes the blocking.
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 8)
    return packed


def _chunked(w: torch.Tensor, width: int) -> PackedWeight:
    """``w`` [out, in] reordered in column chunks of ``width`` (the last one what is left)."""
    bounds = (*range(0, w.shape[1], width), w.shape[1])
    return PackedWeight(tuple(_reorder(w[:, a:b]) for a, b in pairwise(bounds)), bounds)


def _row_invariant(dtype: torch.dtype, in_features: int, out: int, width: int) -> bool:
    """Whether a weight [out, in_features] packed in chunks of ``width`` gives every row alike
    for one row and for each probed row count (a random weight and input, bit for bit): the
    exact chunking it will be served with, remainder chunk included."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(out, in_features, generator=g) * 0.05).to(dtype)  # [out, in]
    x = torch.randn(max(_PROBE_ROWS), in_features, generator=g).to(dtype)  # [M, in]
    packed = _chunked(w, width)
    ref = torch.cat([packed.matmul(x[i : i + 1]) for i in range(_PROBE_REFERENCE_ROWS)])
    for m in _PROBE_ROWS:
        rows = min(m, _PROBE_REFERENCE_ROWS)
        if not torch.equal(packed.matmul(x[:m])[:rows], ref[:rows]):
            return False
    return True


@dataclass
class RowInvariance:
    """The widest row-invariant chunk of a reduction, per (dtype, input features, output
    features), probed the first time a weight of that shape is packed and remembered for the
    rest (one instance per model being packed)."""

    _widths: dict[tuple[torch.dtype, int, int], int] = field(default_factory=dict)

    def chunk_width(self, dtype: torch.dtype, in_features: int, out_features: int) -> int:
        key = (dtype, in_features, min(out_features, _PROBE_MAX_OUT))
        if key not in self._widths:
            self._widths[key] = self._probe(*key)
        return self._widths[key]

    @staticmethod
    def _probe(dtype: torch.dtype, in_features: int, out: int) -> int:
        """``in_features`` if the whole reduction is row-invariant, else the widest of
        ``_CHUNKS`` whose chunking is; if none is, the narrowest, logged (rows may then differ
        in their last bits with the number of rows in a step)."""
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
    """``w`` [out, in] reordered for oneDNN's CPU matmul, in row-invariant column chunks
    (``invariance``: the probe results to share across a model's weights), or None where there
    is no such path (a GPU tensor, a build without oneDNN, a CPU lacking the instructions for
    the dtype)."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        width = (invariance or RowInvariance()).chunk_width(w.dtype, w.shape[1], w.shape[0])
    except RuntimeError:  # e.g. bf16 on a CPU without AVX-512 BF16
        return None
    return _chunked(w, width)
