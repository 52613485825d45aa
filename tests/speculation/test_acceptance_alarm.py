"""The acceptance-collapse alarm: a cell is reported once it has evidence that its drafts are
accepted far less than planned, speculation backs off for it, it clears when outcomes match the
plan again; on a real engine whose calibration remembers a drafter that accepted well, a
mismatched drafter trips it, and /health's pool summary says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from serving.health_board import pool_health
from speculation.acceptance_alarm import AcceptanceAlarm
from speculation.calibration import calibration_key
from tests.decode.engine_utils import make_request, run_all

GREEDY = calibration_key(None, 0.0)
SAMPLED = calibration_key(None, 0.8)


def test_a_cell_collapses_with_evidence_backs_off_and_clears() -> None:
    alarm = AcceptanceAlarm(ratio=0.5, window_tokens=400)
    for _ in range(3):  # 150 draft tokens: under half a window, no verdict yet
        alarm.record(GREEDY, 0.8, 50, 5)
    assert alarm.collapsed() == ()
    for _ in range(2):  # 250: 10 % accepted where 80 % was predicted
        alarm.record(GREEDY, 0.8, 50, 5)
    alarm.record(SAMPLED, 0.5, 300, 140)  # 47 % of 50 %: fine
    (c,) = alarm.collapsed()
    assert (c.temperature_bin, c.probe_bin) == GREEDY
    assert c.realised == pytest.approx(0.1) and c.expected == pytest.approx(0.8)
    assert alarm.backoff(GREEDY, 0.7) == pytest.approx(0.1)
    assert alarm.backoff(SAMPLED, 0.5) == 0.5
    for _ in range(20):  # calibration caught up: predictions match outcomes again
        alarm.record(GREEDY, 0.12, 50, 6)
    assert alarm.collapsed() == () and alarm.backoff(GREEDY, 0.7) == 0.7


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ratio must lie in"):
        AcceptanceAlarm(ratio=1.0, window_tokens=100)


def test_a_mismatched_drafter_trips_the_alarm_on_a_real_engine(
    tiny_folder: Path, tiny_draft_folder: Path
) -> None:
    """The replica's calibration remembers 90 % acceptance for greedy requests (a drafter that
    matched); the random tiny draft now serving accepts almost nothing. k pinned at 4, so every
    request verifies drafts whatever its estimate."""
    draft = DraftSpec(
        DraftKind.DRAFT_MODEL,
        model=ModelSpec(str(tiny_draft_folder)),
        num_speculative_tokens=4,
        adaptive=False,
    )
    cfg = DecodeEngineConfig(
        "t", ModelSpec(str(tiny_folder)), draft, num_blocks=128, acceptance_alarm_window_tokens=256
    )
    engine = DecodeEngine(cfg)
    spec = engine.speculation
    assert spec is not None
    spec.calibration.record(GREEDY, 4096, 3686)
    g = torch.Generator().manual_seed(5)
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    reqs = [
        make_request(torch.randint(3, 49152, (12,), generator=g).tolist(), sp) for _ in range(6)
    ]
    run_all(engine, reqs)
    drafted = sum(r.stats.num_draft_tokens for r in reqs)
    accepted = sum(r.stats.num_accepted_tokens for r in reqs)
    assert drafted >= 128 and accepted < 0.45 * drafted  # the premise: it accepts little
    (c,) = spec.alarm.collapsed()
    assert (c.temperature_bin, c.probe_bin) == GREEDY and c.realised < 0.5 * c.expected
    late = make_request([5, 6, 7, 8], sp)
    spec.start(late)  # backs off: starts from what the cell realised, not what it remembers
    assert late.start_estimate is not None and late.start_estimate > 0.5
    assert late.acceptance_estimate == pytest.approx(c.realised)

    entry = {"running": 0, "drafter": "draft_model", "acceptance_collapse": [c.to_dict()]}
    health = pool_health("decode", {"r1": entry, "r2": {"running": 1}}, 0.2)
    assert health.acceptance_collapse == ("r1",)
    assert health.degraded is not None and "acceptance collapsed on 1 replica" in health.degraded
    assert "drafter draft_model" in health.degraded
