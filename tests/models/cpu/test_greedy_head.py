"""The bf16 screen of an fp32 LM head (``models.cpu.greedy_head``): the token it returns is the full
head's ``argmax(-1)`` exactly, for random rows, for winners decided below bf16's resolution,
for exact ties (the lowest index) and for rows that are not finite; and a model's ``head``
returns the full logits of the rows that want them beside the argmax of every row."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from models.cpu.greedy_head import GreedyHead, dense_table
from models.cpu.linear import CpuPacker, PanelUse, PanelWeight
from models.spec import ModelSpec
from tests.helpers import make_tiny_checkpoint, serve_on_cpu

# the screen multiplies in bf16 on the panel kernel: CPUs with AVX-512 BF16 (the tier's marker)
pytestmark = pytest.mark.cpu_bf16


SCREENS = ("panel", "dense")  # the panel kernel's bf16 screen; oneDNN's bf16 matmul


def _head(w: torch.Tensor, which: str = "panel") -> tuple[PanelWeight, GreedyHead]:
    """The fp32 head of ``w`` and a screen that screens every call with ``which`` (the dense
    table is set whether or not this CPU has AMX: oneDNN multiplies bf16 on any CPU, and the
    bound must hold for its arithmetic wherever it runs)."""
    exact = CpuPacker(use=PanelUse.ALWAYS).pack(w)
    assert isinstance(exact, PanelWeight)
    screen = GreedyHead.build(w, exact)
    assert screen is not None
    if which == "dense":
        screen.dense, screen.max_rows = dense_table(w.to(torch.bfloat16)), 0
    else:
        screen.dense, screen.max_rows = None, 1 << 30
    return exact, screen


@pytest.mark.parametrize("which", SCREENS)
def test_the_screen_gives_the_full_heads_argmax_on_random_rows(which: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1001, 64, generator=g) * 0.2  # [V, K]: a partial last panel
    exact, screen = _head(w, which)
    for scale in (0.1, 1.0, 10.0):  # flat to peaked distributions
        h = torch.randn(300, 64, generator=g) * scale  # [N, K]
        want = exact.matmul(h).argmax(dim=-1)
        assert torch.equal(screen.argmax(h), want)
    assert screen.screened == 900 and screen.fallbacks == 0


@pytest.mark.parametrize("which", SCREENS)
def test_winners_below_bf16_resolution_and_exact_ties(which: str) -> None:
    """Rows that bf16 cannot tell apart: the screen keeps them all and the exact logits pick
    the winner; equal rows tie, and the lowest index wins, as in ``argmax``."""
    g = torch.Generator().manual_seed(1)
    k = 32
    w = torch.randn(400, k, generator=g) * 0.1
    base = torch.randn(k, generator=g).to(torch.bfloat16).float()  # on bf16's grid
    base[0] = 1.0
    step = 2.0**-12  # far below bf16's resolution at 1 (2^-8): both round back to 1
    w[[17, 250, 90, 300]] = base  # then 250 a step up and 90 a step down in component 0
    w[:, 0] = 0.0  # other rows: component 0 does not favour them
    w[[17, 250, 90, 300], 0] = torch.tensor([1.0, 1.0 + step, 1.0 - step, 1.0])
    h = 10 * base.expand(4, k).clone()  # [4, K]: these rows' best tokens are 17, 90, 250, 300
    h[1, 0] = -50.0  # component 0 negative: row 90's step down wins
    h[2, 0] = 50.0  # positive: row 250's step up wins
    h[3, 0] = 0.0  # no difference: 17, 250, 90 and 300 tie, and 17 comes first
    exact, screen = _head(w, which)
    full = exact.matmul(h)  # [4, V]
    assert torch.equal(screen.argmax(h), full.argmax(dim=-1))
    assert full[1].argmax() == 90 and full[2].argmax() == 250 and full[3].argmax() == 17
    assert bf16_equal(w[17], w[250]) and bf16_equal(w[17], w[90])  # the screen saw ties


@pytest.mark.parametrize("which", SCREENS)
def test_a_winner_the_screen_ranks_below_another(which: str) -> None:
    """Rounding the weights to bf16 reverses two tokens: the screen's best is not the head's,
    and the bound keeps the head's."""
    w = torch.zeros(40, 2)
    w[7] = torch.tensor([100.2, 100.0])  # exact 0.2 (bf16: 100.0, 100.0 -> 0.0)
    w[30] = torch.tensor([100.3, 100.2])  # exact 0.1 (bf16: 100.5, 100.0 -> 0.5)
    h = torch.tensor([[1.0, -1.0]])
    exact, screen = _head(w, which)
    assert screen._screen(h).float().argmax() == 30
    assert exact.matmul(h).argmax() == 7
    assert screen.argmax(h).tolist() == [7]


def bf16_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16))


@pytest.mark.parametrize("which", SCREENS)
def test_rows_that_are_not_finite_take_the_full_head(which: str) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(200, 16, generator=g)
    exact, screen = _head(w, which)
    h = torch.randn(5, 16, generator=g)
    h[1, 3] = math.nan
    h[3, 0] = math.inf
    assert torch.equal(screen.argmax(h), exact.matmul(h).argmax(dim=-1))
    assert screen.fallbacks == 2


def test_no_screen_for_a_head_that_is_not_fp32() -> None:
    w = torch.randn(64, 32).to(torch.bfloat16)
    packed = CpuPacker(use=PanelUse.ALWAYS).pack(w)
    assert isinstance(packed, PanelWeight)
    assert GreedyHead.build(w, packed) is None


def test_a_models_head_computes_logits_where_asked_and_every_argmax(
    embedded_folder: Path, tmp_path: Path
) -> None:
    folder = make_tiny_checkpoint(tmp_path / "m", embedded_folder, seed=3, vocab_size=700)
    model = ModelSpec(str(folder)).load()
    served = serve_on_cpu(model)
    assert served.packed and served.screen is not None
    assert "bf16 screen" in served.matmul_path()
    h = torch.randn(6, model.cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    full = model.logits(h)  # [6, V]
    only = [True, False, True, True, False, True]
    logits, tokens = served.head(h, only)
    assert tokens is not None and torch.equal(tokens, full.argmax(dim=-1))
    for i, o in enumerate(only):
        if o:
            assert bool(logits[i].isnan().all())
        else:
            assert torch.equal(logits[i], full[i])
    logits, tokens = served.head(h, [True] * 6)
    assert tokens is not None and torch.equal(tokens, full.argmax(dim=-1))
    assert logits.shape == full.shape and bool(logits.isnan().all())
    logits, tokens = served.head(h, [False] * 6)
    assert tokens is None and torch.equal(logits, full)


def test_more_rows_than_the_screen_takes_get_the_full_head(
    embedded_folder: Path, tmp_path: Path
) -> None:
    """Past ``max_rows`` greedy rows a step takes the full head: every row's logits, no tokens
    (the caller argmaxes them), the same argmax the screen gives below the limit; with the
    dense table (AMX tiles) the screen takes them too."""
    folder = make_tiny_checkpoint(tmp_path / "m", embedded_folder, seed=5, vocab_size=700)
    model = ModelSpec(str(folder)).load()
    served = serve_on_cpu(model)
    assert served.packed
    screen = served.screen
    assert screen is not None
    h = torch.randn(9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    full = model.logits(h)  # [9, V]
    screen.max_rows = 9
    logits, tokens = served.head(h, [True] * 9)
    assert tokens is not None and torch.equal(tokens, full.argmax(dim=-1))
    assert bool(logits.isnan().all())
    screen.max_rows = 8
    screen.dense = None  # a CPU without AMX tiles: no screen for 9 rows
    logits, tokens = served.head(h, [True] * 9)
    assert tokens is None and torch.equal(logits, full)
    screen.dense = dense_table(model.lm_head.weight.to(torch.bfloat16))  # a CPU with them
    logits, tokens = served.head(h, [True] * 9)
    assert tokens is not None and torch.equal(tokens, full.argmax(dim=-1))
    assert screen.screened == 18
