"""What one load run measured: per-request records and the pure functions that summarise them.

Definitions (those of vLLM's ``benchmark_serving``):

- TTFT: request sent -> first chunk that carries content.
- ITL: time between successive content chunks of one request (a chunk may hold several tokens
  when speculation accepts drafts, so ITL is per chunk, not per token).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, undefined for a single output token.
- E2E: request sent -> end of the stream.
- Throughput: over the run's wall time, counting completed requests only.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    OK = "ok"
    ERROR = "error"  # an HTTP error status, an error event in the stream, or a transport failure
    CANCELLED = "cancelled"  # still in flight when the run's time limit came


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds; offsets are from the run's start."""

    index: int  # position in the workload
    kind: str  # workload class: "sharegpt", "synthetic", "copy"
    max_tokens: int
    start_s: float  # when it was sent, from the run's start
    outcome: Outcome
    error: str | None = None  # error key: an HTTP status ("503"), "stream_error", an exception
    content_times_s: tuple[float, ...] = ()  # arrival of each content chunk, from start_s
    e2e_s: float | None = None  # sent -> end of stream (OK requests)
    prompt_tokens: int | None = None  # from usage, when the server sent it
    output_tokens: int = 0  # from usage; the count of content chunks when no usage came
    draft_tokens: int | None = None  # usage.speculative, when the server reports it
    accepted_tokens: int | None = None
    mean_accepted_length: float | None = None  # tokens per verification step, bonus included
    num_steps: int | None = None  # verification steps that carried drafts, if the server says

    @property
    def ttft_s(self) -> float | None:
        return self.content_times_s[0] if self.content_times_s else None

    @property
    def itl_s(self) -> tuple[float, ...]:
        return inter_token_latencies(self.content_times_s)

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None:
            return None
        return tpot(self.e2e_s, self.ttft_s, self.output_tokens)


@dataclass(frozen=True)
class Stats:
    """Mean and percentiles of one latency, in seconds, over ``count`` values."""

    count: int
    mean: float
    p50: float
    p99: float


@dataclass(frozen=True)
class Summary:
    """A whole run, as reported in the table and the JSON."""

    num_sent: int  # requests issued (completed, failed, or cancelled at the time limit)
    completed: int
    failed: int
    cancelled: int
    errors: Mapping[str, int]  # error key -> count
    duration_s: float
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens of completed requests per second
    total_prompt_tokens: int
    total_output_tokens: int
    ttft: Stats | None
    tpot: Stats | None
    itl: Stats | None
    e2e: Stats | None
    acceptance_rate: float | None  # accepted / drafted tokens, over all completed requests
    mean_accepted_per_step: float | None  # accepted tokens / verification steps, pooled


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between order statistics (numpy's
    default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: Sequence[float]) -> Stats | None:
    """Mean, p50 and p99; None for no values."""
    if not values:
        return None
    return Stats(
        len(values), sum(values) / len(values), percentile(values, 50), percentile(values, 99)
    )


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first; None when there is no second token."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def inter_token_latencies(content_times_s: Sequence[float]) -> tuple[float, ...]:
    """Gaps between successive content chunks."""
    return tuple(b - a for a, b in itertools.pairwise(content_times_s))


def verification_steps(r: RequestRecord) -> float | None:
    """A request's verification steps that carried drafts: as the server reported them, or
    recovered from ``mean_accepted_length = (accepted + steps) / steps``, which cannot be
    inverted when nothing was accepted (None then)."""
    if r.num_steps is not None:
        return float(r.num_steps)
    m, accepted = r.mean_accepted_length, r.accepted_tokens
    if m is None or not accepted or m <= 1.0:
        return None
    return accepted / (m - 1.0)


def acceptance(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """(accepted / drafted tokens, accepted tokens per verification step), both pooled over the
    requests that drafted; None where nothing drafted. The per-step figure leaves out requests
    whose step count is unknown (see :func:`verification_steps`)."""
    drafted = [r for r in records if r.draft_tokens]
    if not drafted:
        return None, None
    rate = sum(r.accepted_tokens or 0 for r in drafted) / sum(r.draft_tokens or 0 for r in drafted)
    known = [(r.accepted_tokens or 0, n) for r in drafted if (n := verification_steps(r))]
    per_step = sum(a for a, _ in known) / sum(n for _, n in known) if known else None
    return rate, per_step


def summarize(records: Sequence[RequestRecord], duration_s: float) -> Summary:
    """Everything the report shows, from the records of one run of ``duration_s`` seconds."""
    ok = [r for r in records if r.outcome is Outcome.OK]
    errors = Counter(r.error or "unknown" for r in records if r.outcome is Outcome.ERROR)
    out_tokens = sum(r.output_tokens for r in ok)
    rate, per_step = acceptance(ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return Summary(
        num_sent=len(records),
        completed=len(ok),
        failed=sum(errors.values()),
        cancelled=sum(1 for r in records if r.outcome is Outcome.CANCELLED),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        output_throughput=out_tokens * per_s,
        total_prompt_tokens=sum(r.prompt_tokens or 0 for r in ok),
        total_output_tokens=out_tokens,
        ttft=stats([t for r in ok if (t := r.ttft_s) is not None]),
        tpot=stats([t for r in ok if (t := r.tpot_s) is not None]),
        itl=stats([x for r in ok for x in r.itl_s]),
        e2e=stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        acceptance_rate=rate,
        mean_accepted_per_step=per_step,
    )
