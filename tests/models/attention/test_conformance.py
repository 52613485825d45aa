"""Every attention backend this machine has, against the reference on identical inputs: the
same outputs (to the dtype's rounding) and the same pool bytes written, over batched decodes,
chain verifications, ragged prompt chunks, a draft tree, sliding windows, layer- and
block-major pools, a TP rank's head slice, fp32 and bf16. A new backend joins ``BACKENDS``
(``tests/gpu`` runs the same cases on a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from models.attention.backend import AttentionBackend, paged_attention
from models.attention.flex import FlexBackend, FlexGroup
from models.attention.flex_kernel import FlexKernel
from models.attention.metadata import AttentionSpec, SeqSlice
from models.attention.reference import ReferenceBackend
from models.cpu.attention import CpuAttentionBackend
from models.cpu.paged import NativeGroup
from tests.models.attention.cases import CASES, StepCase, in_block_major, layer_spec

HKV, G, D, BS, NB = 4, 3, 32, 16, 200
TP = 2  # the head slice is rank 1 of TP = 2

Factory = Callable[[AttentionSpec], AttentionBackend]
BACKENDS: dict[str, Factory] = {
    "gather": ReferenceBackend,
    "gather_exact": lambda spec: ReferenceBackend(spec, exact=True),
    "cpu_paged": CpuAttentionBackend,
    "flex": lambda spec: FlexBackend(spec, FlexKernel(min_context_tokens=0)),
}
TOL = {
    torch.float32: {"atol": 3e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def _inputs(
    case: StepCase, dtype: torch.dtype
) -> tuple[list[SeqSlice], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The case's sequences, a layer [NB, 2, HKV, BS, D], and q [T, HKV * G, D], k, v."""
    gen = torch.Generator().manual_seed(7)
    seqs = case.seqs(NB, BS, gen)
    t = sum(s.num_new for s in seqs)
    layer = torch.randn(NB, 2, HKV, BS, D, generator=gen).to(dtype)
    q = torch.randn(t, HKV * G, D, generator=gen).to(dtype)
    k = torch.randn(t, HKV, D, generator=gen).to(dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(dtype)
    return seqs, layer, q, k, v


def _attend(
    make: Factory,
    seqs: list[SeqSlice],
    layer: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
) -> tuple[torch.Tensor, AttentionBackend, tuple[object, ...]]:
    """One layer's step through a backend: [T, Hq * D], the backend and its groups."""
    backend = make(layer_spec(layer, G, window))
    meta = backend.plan(seqs)
    return paged_attention(q, k, v, layer, meta, D**-0.5), backend, meta.groups


IN_PLACE = ("cpu_paged", "flex")  # read the pool in place in every case (the others gather)


def _variants() -> list[tuple[StepCase, torch.dtype, int | None, bool, bool]]:
    """Every case at each dtype on a plain layer-major pool, then the mixed step under every
    combination of window, pool layout and head slice."""
    mixed = next(c for c in CASES if c.name == "mixed")
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        out += [(case, dtype, None, False, False) for case in CASES]
        for window in (None, 48):
            for block_major in (False, True):
                for head_slice in (False, True):
                    if window or block_major or head_slice:
                        out.append((mixed, dtype, window, block_major, head_slice))
    return out


def _params() -> list[object]:
    out = []
    for name in BACKENDS:
        for case, dtype, window, block_major, head_slice in _variants():
            layout = "block" if block_major else "layer"
            cid = f"{name}-{case.name}-{str(dtype)[6:]}-w{window}-{layout}"
            cid += f"-tp{TP if head_slice else 1}"
            values = (name, case, dtype, window, block_major, head_slice)
            if name != "flex":
                out.append(pytest.param(*values, id=cid))
            elif _flex_covers(case, dtype, window, block_major, head_slice):
                out.append(pytest.param(*values, id=cid, marks=pytest.mark.slow))
    return out


def _flex_covers(
    case: StepCase, dtype: torch.dtype, window: int | None, block_major: bool, head_slice: bool
) -> bool:
    """flex compiles kernels per shape on a CPU (5-12 s a case here; every case passed once,
    and its layouts have tests of their own in ``test_flex.py``): the mixed step (decodes,
    verifications, a tree, prompt chunks) plain in fp32, and in bf16 over a block-major head
    slice, each with and without a window."""
    plain = not block_major and not head_slice
    sliced = dtype == torch.bfloat16 and block_major and head_slice
    return case.name == "mixed" and ((dtype == torch.float32 and plain) or sliced)


@pytest.mark.parametrize(
    ("name", "case", "dtype", "window", "block_major", "head_slice"), _params()
)
def test_backend_matches_the_reference(
    name: str,
    case: StepCase,
    dtype: torch.dtype,
    window: int | None,
    block_major: bool,
    head_slice: bool,
) -> None:
    seqs, layer, q, k, v = _inputs(case, dtype)
    want_pool = layer.clone()
    want, _, _ = _attend(BACKENDS["gather_exact"], seqs, want_pool, q, k, v, window)
    heads = slice(None)
    if head_slice:  # rank 1's KV heads in a pool of its own, and its query heads
        h = HKV // TP
        heads = slice(h, 2 * h)
        layer, want_pool = layer[:, :, heads].contiguous(), want_pool[:, :, heads]
        q = q[:, h * G : 2 * h * G]
        k, v = k[:, heads], v[:, heads]
        want = want.view(-1, HKV, G * D)[:, heads].reshape(q.shape[0], -1)
    mine = in_block_major(layer) if block_major else layer.clone()
    got, backend, groups = _attend(BACKENDS[name], seqs, mine, q, k, v, window)
    assert torch.equal(mine, want_pool)  # the step's K/V, where the reference wrote them
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    assert backend.fallbacks == 0
    if name in IN_PLACE:
        served = [g for g in groups if isinstance(g, NativeGroup | FlexGroup)]
        assert served, f"{name} served nothing in place"
        if name == "flex":  # every sequence: decodes, verifications, trees, prompt chunks
            assert all(isinstance(g, FlexGroup) for g in groups)
