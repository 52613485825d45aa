"""The decode pool over a day under an autoscaling policy: a fluid model per control interval.

Each interval of ``step_s``, given the arrival rate and the mix's replica curve (``replica.py``):

- **replicas** the scaler adds serve ``startup_s`` later and are paid from the start; it removes
  the newest first, so those still starting go first (as Serve stops them first);
- **streams**: arrivals spread evenly over the running replicas, each holding the streams at
  which it completes its share (Little's law on the curve). Arrivals beyond what they complete
  at their most streams wait in a backlog carried to the next interval and served first;
- **attainment**: the share of the interval's arrivals within the TPOT SLO at that mean load
  (the curve's, replicas spread around the mean); none where the backlog keeps them waiting past
  the TTFT SLO;
- **metrics**, as ``DecodeServer.record_autoscaling_stats`` reports them: each running replica's
  streams (running and queued: the backlog shared out), its ``capacity_streams`` (the curve's
  ``reported``), the tokens/s it delivered and the tokens/s it predicts at capacity, averaged
  over ``look_back_s`` as Serve's controller averages them;
- **policies**: ``requests`` is Serve's default rule, ``ceil(streams / target_ongoing_requests)``;
  ``goodput`` is ``cluster.capacity_policy.decide`` (tokens/s delivered over tokens/s
  predicted at capacity) with ``downscale_utilization`` ``band`` below its target; ``dynamo``
  is Dynamo's SLA planner with its speculation support (ai-dynamo/dynamo PR #10435): a profile
  of the forward's time by concurrency, taken once on a representative mix; the pool's mean
  accept length, scraped; the inter-token latency a forward gives divided by it; the observed
  over the profiled latency as its correction factor; the replicas whose throughput at the
  largest concurrency within its ITL target (its knob) carries the arrivals' tokens/s;
  ``dynamo_profiled`` is that planner with the latency per token taken from a profile run with
  speculation on (no scraped accept length). Serve then
  applies its upscale and downscale delays (``serve_delays``: a change applies once the policy
  has wanted one in the same direction for the delay) and the pool's bounds, the same for all.

What a fluid model leaves out: queueing and batch fluctuation within an interval beyond the
spread, prefill and KV transfer (TTFT counts the decode backlog only), stragglers that keep a
removed replica busy. The ground truth is the goodput model the policy's capacity comes from,
so the comparison prices knowing the capacity, not the model's accuracy on hardware.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable
from dataclasses import astuple, dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from bench.autoscalesim.replica import ReplicaCurve
from cluster.capacity_policy import decide

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class Rule(StrEnum):
    REQUESTS = "requests"  # Serve's default: streams over target_ongoing_requests
    GOODPUT = "goodput"  # cluster.capacity_policy: delivered over predicted tokens/s
    DYNAMO = "dynamo"  # Dynamo's SLA planner: profiled forward time over the mean accept length
    DYNAMO_PROFILED = "dynamo_profiled"  # the same, latency per token profiled with speculation


@dataclass(frozen=True)
class Report:
    """What a running replica reports (``record_autoscaling_stats``), or its look-back mean."""

    streams: float  # running and queued
    capacity_streams: float  # predicted within the SLO at its mix
    goodput_tok_s: float  # delivered
    capacity_tok_s: float  # predicted at capacity (goodput plus headroom)
    accept_length: float = 1.0  # mean tokens a stream emits a verifying forward
    itl_s: float = 0.0  # mean inter-token latency: the step over the accept length
    arrival_tok_s: float = 0.0  # the frontend's arrivals times their mean output, its share


@dataclass(frozen=True)
class Policy:
    """An autoscaling rule and its one knob."""

    rule: Rule
    knob: float  # requests: target_ongoing_requests; goodput: target_utilization; dynamo: ITL s
    band: float = 0.3  # goodput: downscale_utilization is the knob minus this
    fallback_streams: float = 48.0  # goodput: per replica while none reports capacity
    profile_step_s: tuple[float, ...] = ()  # dynamo: its profiled forward time by concurrency
    profile_accept: tuple[float, ...] = ()  # dynamo_profiled: the profile's accept lengths

    def desired(self, running: int, r: Report) -> int:
        """Replicas wanted when each of ``running`` replicas reports ``r``.

        Every running replica reports the same values here, so ``decide`` gets the pool's
        load as one entry and the capacity of one replica, which it counts for the others
        (its rule for replicas yet to report): the decision one entry a replica gives, without
        building thousands of entries each interval (``tests/bench/test_autoscale_sim.py``
        checks the two agree)."""
        if self.rule is Rule.REQUESTS:
            return math.ceil(running * r.streams / self.knob)
        if self.rule in (Rule.DYNAMO, Rule.DYNAMO_PROFILED):
            return self._dynamo(running, r)
        return decide(
            running,
            {"pool": running * r.goodput_tok_s},
            {"replica": r.capacity_tok_s},
            {"pool": running * r.streams},
            self.knob,
            self.knob - self.band,
            self.fallback_streams,
        ).replicas

    def _dynamo(self, running: int, r: Report) -> int:
        """The SLA planner's decode replicas: the largest profiled concurrency whose
        inter-token latency, corrected by observed over expected, is within the ITL target; the
        arrivals' tokens/s over what a replica emits there. ``dynamo`` divides the profiled
        forward by the scraped accept length; ``dynamo_profiled`` took the latency per token
        from a profile run with speculation on, as its planner does without PR #10435."""
        prof = np.asarray(self.profile_step_s)  # [most + 1] seconds a forward at n
        if self.rule is Rule.DYNAMO:
            itl = prof / r.accept_length  # [most + 1]
        else:
            itl = np.maximum.accumulate(prof / np.asarray(self.profile_accept))
        n_obs = min(max(r.streams, 1.0), len(prof) - 1)
        expected = float(np.interp(n_obs, np.arange(len(prof)), itl))
        correction = r.itl_s / expected if r.itl_s > 0 else 1.0
        ok = np.flatnonzero(itl[1:] * correction <= self.knob) + 1
        n = int(ok[-1]) if ok.size else 1
        per_replica_tok_s = float(n / (itl[n] * correction))
        return math.ceil(running * r.arrival_tok_s / per_replica_tok_s)


@dataclass(frozen=True)
class Scaling:
    """What Serve applies around either policy, and what a new replica costs."""

    min_replicas: int
    max_replicas: int
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    startup_s: float = 120.0  # from added (and paid) to serving
    look_back_s: float = 30.0  # metrics averaged over this


@dataclass(frozen=True)
class Wanted:
    """Serve's pending decision: the direction wanted since ``since_s`` (0: none)."""

    direction: int
    since_s: float


def serve_delays(
    desired: int, target: int, wanted: Wanted, now: float, s: Scaling
) -> tuple[int, Wanted]:
    """Serve's ``_apply_delay_logic``: the target moves to what the policy wants now once it
    has wanted a move in that direction for the direction's delay; wanting none, or the other
    direction, restarts the clock."""
    direction = (desired > target) - (desired < target)
    if direction == 0:
        return target, Wanted(0, now)
    if wanted.direction != direction:
        wanted = Wanted(direction, now)
    delay = s.upscale_delay_s if direction > 0 else s.downscale_delay_s
    if now - wanted.since_s + 1e-6 >= delay:
        return desired, Wanted(0, now)
    return target, wanted


@dataclass(frozen=True)
class World:
    """The day as every policy sees it: arrivals, mix curves, SLO beyond the curves."""

    step_s: float
    rate_rps: FloatArray  # [steps] arrivals per second
    level: IntArray  # [steps] index into curves
    curves: tuple[ReplicaCurve, ...]  # per mix level
    ttft_slo_s: float
    tpot_slo_s: float

    @property
    def steps(self) -> int:
        return len(self.rate_rps)

    def oracle_replicas(self) -> IntArray:
        """[steps] replicas that hold each interval's arrivals at capacity: the demand in
        capacity-replicas (no spread, no delays, no start-up)."""
        per = np.array([c.capacity_rps for c in self.curves])[self.level]  # [steps]
        out: IntArray = np.ceil(self.rate_rps / per).astype(np.int64)
        return out


@dataclass(frozen=True)
class Interval:
    report: Report  # what each running replica reports for it
    backlog: float  # requests waiting at its end
    attainment: float  # share of its arrivals within the SLOs


def serve_interval(
    curve: ReplicaCurve, rps: float, running: int, backlog: float, w: World
) -> Interval:
    """One interval of the fluid model (module doc)."""
    most_rps = float(curve.throughput_rps[-1]) * running
    if backlog == 0 and rps <= most_rps:
        n = curve.streams_for(rps / running)
        served, attained = rps, curve.attainment_at(n)
    else:
        backlog = max(backlog + (rps - most_rps) * w.step_s, 0.0)
        n = curve.most + backlog / running
        late = backlog / most_rps > w.ttft_slo_s
        served, attained = most_rps, 0.0 if late else float(curve.attainment[-1])
    tok_s = served / running * curve.output_tokens
    accepted = curve.at(curve.accept_length, n)
    report = Report(
        n,
        curve.reported,
        tok_s,
        curve.reported_tok_s,
        accepted,
        curve.at(curve.step_s, n) / accepted,
        rps / running * curve.output_tokens,
    )
    return Interval(report, backlog, attained)


@dataclass(frozen=True)
class DayRun:
    """One policy's day."""

    policy: Policy
    replica_hours: float  # running and starting replicas, summed over the day
    attainment: float  # share of the day's arrivals within the SLOs
    scale_events: int  # times the pool's target changed
    peak_replicas: int
    replicas: IntArray  # [steps] paid for (running and starting)
    running: IntArray  # [steps] serving
    streams: FloatArray  # [steps] per running replica
    hourly_attainment: FloatArray  # [hours] share of each hour's arrivals within the SLOs


def simulate(w: World, policy: Policy, s: Scaling) -> DayRun:
    """``policy``'s day on ``w`` (module doc)."""
    start = _steady_replicas(w, policy, s)
    ready = [0.0] * start  # when each replica serves, in the order added
    target, wanted, backlog, events = start, Wanted(0, 0.0), 0.0, 0
    reports: deque[Report] = deque(maxlen=max(1, round(s.look_back_s / w.step_s)))
    paid, serving = np.zeros(w.steps, np.int64), np.zeros(w.steps, np.int64)  # [steps]
    streams, attained = np.zeros(w.steps), np.zeros(w.steps)  # [steps]
    for i in range(w.steps):
        now = i * w.step_s
        running = bisect.bisect_right(ready, now)
        curve = w.curves[int(w.level[i])]
        iv = serve_interval(curve, float(w.rate_rps[i]), running, backlog, w)
        backlog = iv.backlog
        paid[i], serving[i], attained[i] = len(ready), running, iv.attainment
        streams[i] = iv.report.streams
        reports.append(iv.report)
        want = policy.desired(running, _mean(reports))
        moved, wanted = serve_delays(want, target, wanted, now + w.step_s, s)
        moved = min(max(moved, s.min_replicas), s.max_replicas)
        if moved != target:
            events += 1
            if moved > len(ready):
                ready += [now + w.step_s + s.startup_s] * (moved - len(ready))
            else:
                del ready[moved:]  # the newest first: those still starting
            target = moved
    return _day_run(w, policy, paid, serving, streams, attained, events)


def _mean(reports: deque[Report]) -> Report:
    """The reports' mean, field by field (Serve averages each metric over the look-back)."""
    n = len(reports)
    fields = zip(*(astuple(r) for r in reports), strict=True)
    return Report(*(sum(values) / n for values in fields))


def _steady_replicas(w: World, policy: Policy, s: Scaling) -> int:
    """Replicas the policy settles on for the first interval's arrivals: the day starts
    in a steady state."""
    curve, rps = w.curves[int(w.level[0])], float(w.rate_rps[0])
    replicas = min(max(math.ceil(rps / curve.capacity_rps), s.min_replicas), s.max_replicas)
    for _ in range(50):
        iv = serve_interval(curve, rps, replicas, 0.0, w)
        want = policy.desired(replicas, iv.report)
        want = min(max(want, s.min_replicas), s.max_replicas)
        if want == replicas:
            break
        replicas = want
    return replicas


def _day_run(
    w: World,
    policy: Policy,
    paid: IntArray,
    serving: IntArray,
    streams: FloatArray,
    attained: FloatArray,
    events: int,
) -> DayRun:
    hour = (np.arange(w.steps) * w.step_s // 3600).astype(np.int64)  # [steps]
    arrivals = np.bincount(hour, w.rate_rps)  # [hours]
    met = np.bincount(hour, w.rate_rps * attained)  # [hours]
    return DayRun(
        policy=policy,
        replica_hours=float(paid.sum() * w.step_s / 3600),
        attainment=float(met.sum() / arrivals.sum()),
        scale_events=events,
        peak_replicas=int(paid.max()),
        replicas=paid,
        running=serving,
        streams=streams,
        hourly_attainment=met / arrivals,
    )


@dataclass(frozen=True)
class Tuned:
    """The most economical setting of a policy's knob that reached the goal."""

    best: DayRun  # the cheapest that reached it (else the one that came closest)
    reached: bool
    tried: tuple[DayRun, ...]  # every setting simulated, by knob


def tune(
    run: Callable[[float], DayRun], lo: float, hi: float, grid: int, tol: float, goal: float
) -> Tuned:
    """Search the knob on ``[lo, hi]``: ``grid`` even settings, then bisection to ``tol``
    between the largest that reached ``goal`` attainment and the next that did not. A larger
    knob runs fewer replicas under any rule, so attainment falls with it, though not smoothly
    near the goal (resizes are discrete and their timing shifts with the knob): the setting
    kept is the cheapest of all tried that reached it, and may sit on a ridge another day's
    bursts fall off (the report runs it on held-out days)."""
    tried = {float(x): run(float(x)) for x in np.linspace(lo, hi, grid)}
    reached = [x for x, r in tried.items() if r.attainment >= goal]
    above = [x for x in tried if reached and x > max(reached)]
    if reached and above:
        a, b = max(reached), min(above)
        while b - a > tol:
            m = (a + b) / 2
            tried[m] = run(m)
            a, b = (m, b) if tried[m].attainment >= goal else (a, m)
    ok = [r for r in tried.values() if r.attainment >= goal]
    best = (
        min(ok, key=lambda r: r.replica_hours)
        if ok
        else max(tried.values(), key=lambda r: r.attainment)
    )
    return Tuned(best, bool(ok), tuple(tried[x] for x in sorted(tried)))
