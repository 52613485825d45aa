"""The draft-stopping cutoff: priced as the batch's tokens/s times the marginal seconds of a
scored token, and damped, so a load that crosses a threshold moves it gradually and a load that
jitters around one does not move it at all."""

from __future__ import annotations

import pytest

from speculation.draft_stop import DraftStop


def test_the_cutoff_is_the_rate_times_the_marginal_cost() -> None:
    assert DraftStop.priced(2000.0, 1e-4) == pytest.approx(0.2)
    assert DraftStop.priced(2000.0, 1e-2) == 1.0  # a certain token at most
    assert DraftStop.priced(2000.0, -1e-4) == 0.0  # a step model flat there: draft it all


def test_jitter_does_not_move_it_and_a_real_change_moves_it_gradually() -> None:
    stop = DraftStop()
    for _ in range(50):
        stop.update(2000.0, 1e-4)
    settled = stop.cutoff
    assert settled == pytest.approx(0.2, rel=0.15)
    for i in range(50):  # +-10 % around the same load
        stop.update(2000.0, 1e-4 * (1.1 if i % 2 else 0.9))
    assert stop.cutoff == settled
    path = [stop.update(4000.0, 1e-4) for _ in range(30)]  # the load doubles
    assert path[-1] == pytest.approx(0.4, rel=0.15)
    steps = [b - a for a, b in zip([settled, *path], path, strict=False)]
    assert max(steps) < 0.5 * (path[-1] - settled)  # no jump: several moves get it there
