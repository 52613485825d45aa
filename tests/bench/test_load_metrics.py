"""The pure metric functions of the load client, on small hand-made inputs."""

from __future__ import annotations

import pytest

from bench.load_metrics import (
    Outcome,
    RequestRecord,
    acceptance,
    inter_token_latencies,
    percentile,
    stats,
    summarize,
    tpot,
    verification_steps,
)


def test_percentile_interpolates_linearly_between_order_statistics() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 99) == pytest.approx(3.97)  # pos 2.97: 3 + 0.97 * (4 - 3)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile(xs, 101)


def test_stats_mean_p50_p99() -> None:
    s = stats([0.1, 0.2, 0.3, 0.4, 1.0])
    assert s is not None
    assert s.count == 5
    assert s.mean == pytest.approx(0.4)
    assert s.p50 == pytest.approx(0.3)
    assert s.p99 == pytest.approx(0.4 + 0.96 * 0.6)  # pos 3.96
    assert stats([]) is None


def test_tpot_excludes_the_first_token() -> None:
    assert tpot(e2e_s=1.0, ttft_s=0.2, output_tokens=5) == pytest.approx(0.2)
    assert tpot(e2e_s=1.0, ttft_s=0.2, output_tokens=2) == pytest.approx(0.8)
    assert tpot(e2e_s=1.0, ttft_s=0.2, output_tokens=1) is None
    assert tpot(e2e_s=1.0, ttft_s=0.2, output_tokens=0) is None


def test_inter_token_latencies_are_gaps_between_chunks() -> None:
    assert inter_token_latencies((0.1, 0.3, 0.6)) == pytest.approx((0.2, 0.3))
    assert inter_token_latencies((0.1,)) == ()
    assert inter_token_latencies(()) == ()


def _ok(index: int, times: tuple[float, ...], e2e: float, out: int, **spec: float) -> RequestRecord:
    return RequestRecord(
        index=index,
        kind="synthetic",
        max_tokens=16,
        start_s=0.1 * index,
        outcome=Outcome.OK,
        content_times_s=times,
        e2e_s=e2e,
        prompt_tokens=10,
        output_tokens=out,
        draft_tokens=int(spec["draft"]) if "draft" in spec else None,
        accepted_tokens=int(spec["accepted"]) if "accepted" in spec else None,
        mean_accepted_length=spec.get("length"),
        num_steps=int(spec["steps"]) if "steps" in spec else None,
    )


def test_record_derives_ttft_itl_tpot() -> None:
    r = _ok(0, (0.2, 0.3, 0.5), e2e=0.6, out=5)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.itl_s == pytest.approx((0.1, 0.2))
    assert r.tpot_s == pytest.approx(0.1)  # (0.6 - 0.2) / 4
    empty = _ok(1, (), e2e=0.6, out=0)
    assert empty.ttft_s is None and empty.tpot_s is None and empty.itl_s == ()


def test_verification_steps_from_the_server_or_the_mean_accepted_length() -> None:
    assert verification_steps(_ok(0, (0.1,), 1.0, 9, draft=8, accepted=6, length=2.5)) == 4.0
    assert verification_steps(_ok(0, (0.1,), 1.0, 9, draft=8, accepted=6, steps=3)) == 3.0
    assert verification_steps(_ok(0, (0.1,), 1.0, 3, draft=4, accepted=0, length=1.0)) is None
    assert verification_steps(_ok(0, (0.1,), 1.0, 3)) is None


def test_acceptance_pools_tokens_and_steps() -> None:
    a = _ok(0, (0.1,), 1.0, 9, draft=8, accepted=6, length=2.5)  # 6 accepted over 4 steps
    b = _ok(1, (0.1,), 1.0, 5, draft=4, accepted=1, length=2.0)  # 1 accepted over 1 step
    c = _ok(2, (0.1,), 1.0, 3, draft=4, accepted=0, length=1.0)  # steps unknown
    rate, per_step = acceptance([a, b, c])
    assert rate == pytest.approx(7 / 16)
    assert per_step == pytest.approx(7 / 5)  # c left out: its step count cannot be recovered
    assert acceptance([c]) == (pytest.approx(0.0), None)
    assert acceptance([_ok(3, (0.1,), 1.0, 3)]) == (None, None)  # nothing drafted


def test_summarize_counts_outcomes_throughput_and_latencies() -> None:
    records = [
        _ok(0, (0.2, 0.3, 0.5), e2e=0.6, out=5, draft=8, accepted=4, length=2.0),
        _ok(1, (0.4, 0.8), e2e=1.0, out=3, draft=4, accepted=1, length=1.5),
        RequestRecord(2, "copy", 16, 0.2, Outcome.ERROR, "503"),
        RequestRecord(3, "copy", 16, 0.3, Outcome.ERROR, "ConnectError"),
        RequestRecord(4, "copy", 16, 0.4, Outcome.ERROR, "503"),
        RequestRecord(5, "copy", 16, 0.5, Outcome.CANCELLED, content_times_s=(0.1,)),
    ]
    s = summarize(records, duration_s=2.0)
    assert (s.num_sent, s.completed, s.failed, s.cancelled) == (6, 2, 3, 1)
    assert dict(s.errors) == {"503": 2, "ConnectError": 1}
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(4.0)  # (5 + 3) tokens / 2 s
    assert (s.total_prompt_tokens, s.total_output_tokens) == (20, 8)
    assert s.ttft is not None and s.ttft.count == 2
    assert s.ttft.mean == pytest.approx(0.3)
    assert s.ttft.p50 == pytest.approx(0.3)
    assert s.ttft.p99 == pytest.approx(0.2 + 0.99 * 0.2)
    assert s.tpot is not None and s.tpot.mean == pytest.approx((0.1 + 0.3) / 2)
    assert s.itl is not None and s.itl.count == 3  # 0.1, 0.2, 0.4: the cancelled one excluded
    assert s.itl.mean == pytest.approx(0.7 / 3)
    assert s.itl.p50 == pytest.approx(0.2)
    assert s.e2e is not None and s.e2e.mean == pytest.approx(0.8)
    assert s.acceptance_rate == pytest.approx(5 / 12)
    assert s.mean_accepted_per_step == pytest.approx(5 / (4 + 2))  # steps: 4/1 and 1/0.5


def test_summarize_of_nothing_completed() -> None:
    s = summarize([RequestRecord(0, "x", 4, 0.0, Outcome.ERROR, "500")], duration_s=0.0)
    assert (s.completed, s.failed, s.request_throughput, s.output_throughput) == (0, 1, 0.0, 0.0)
    assert s.ttft is None and s.e2e is None and s.acceptance_rate is None
