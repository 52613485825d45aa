"""How many tokens each request speculates per step: pinned, or chosen for goodput."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from decode.config import DecodeEngineConfig
from decode.drafters.base import Drafter
from kvtransfer.allocator import BlockAllocator
from models.request import Request
from models.weights import default_cache_dir
from runtime.runner import ModelRunner
from runtime.step_timing import METHOD, cached_step_time, calibration_points, measure_step_time
from speculation.acceptance_alarm import AcceptanceAlarm
from speculation.calibration import (
    DEFAULT_ACCEPTANCE,
    PRIOR_TOKENS,
    AcceptanceCalibration,
    Cell,
    calibration_key,
)
from speculation.draft_cost import DraftCost
from speculation.draft_stop import DraftStop
from speculation.goodput import (
    GUARD_MAX_LOSS,
    DraftBatch,
    StepCosts,
    TpotGuard,
    choose_ks,
    expected_tokens,
)
from speculation.step_time import StepTimeModel, StepTimeTracker

EMA = 0.2  # weight of a request's newest verified step in its acceptance estimate
PRIOR_EMA = 0.01  # weight of any request's verified step in the replica's prior
IDLE_EMA = 0.05  # how far an estimate relaxes toward the prior per step verifying no draft


class SpeculationPolicy:
    """A request's acceptance estimate starts from prefill's probe, else the replica's slowly
    averaged prior (one lucky draft must not read as certainty), calibrated per cell."""

    def __init__(
        self,
        k_max: int,
        step_time: StepTimeModel | None,
        step_dependent: bool = False,
        tree_width: int = 1,
        drafter: Drafter | None = None,
        tpot_slo_s: float | None = None,
        tpot_slo_max_loss: float = GUARD_MAX_LOSS,
        alarm: AcceptanceAlarm | None = None,
    ) -> None:
        self.k_max = k_max
        self.tpot_slo_s = tpot_slo_s
        self.tpot_slo_max_loss = tpot_slo_max_loss
        self.tree_width = tree_width
        self.step_dependent = step_dependent
        self.tracker = StepTimeTracker(step_time) if step_time is not None else None  # None: pinned
        self.prior = DEFAULT_ACCEPTANCE
        self.draft_cost = DraftCost()
        self.drafter = drafter
        self.calibration = AcceptanceCalibration()
        self.alarm = alarm if alarm is not None else AcceptanceAlarm(0.5, 1024)

    def start(self, r: Request) -> None:
        if r.calibration_key is not None:
            return
        temperature = 0.0 if r.sampling.greedy else r.sampling.temperature
        r.calibration_key = calibration_key(r.acceptance_probe, temperature)
        r.start_estimate = self.calibration.estimate(r.calibration_key, self.estimate(r))
        r.acceptance_estimate = self.alarm.backoff(r.calibration_key, r.start_estimate)

    def finished(self, r: Request) -> None:
        if r.calibration_key is not None:
            drafted, accepted = r.stats.num_draft_tokens, r.stats.num_accepted_tokens
            self.calibration.record(r.calibration_key, drafted, accepted)
            if r.start_estimate is not None:
                self.alarm.record(r.calibration_key, r.start_estimate, drafted, accepted)

    def seed(self, cells: Sequence[Cell]) -> float:
        seeded = self.calibration.seed(cells)
        drafted = sum(c.drafted for c in cells)
        if drafted >= PRIOR_TOKENS:
            self.prior = sum(c.accepted for c in cells) / drafted
        return seeded

    def stop_cutoff(self, reqs: Sequence[Request], ks: Sequence[int], stop: DraftStop) -> float:
        """``stop``'s cutoff for a step of ``reqs`` granted ``ks``: the planned batch's
        expected tokens/s times the marginal seconds of one more scored token."""
        if self.tracker is None or not any(ks):
            return stop.cutoff
        model = self.tracker.model
        scored = sum(1 + k for k in ks)
        step_s = model.predict(scored)
        emitted = sum(expected_tokens(self.estimate(r), k) for r, k in zip(reqs, ks, strict=True))
        return stop.update(emitted / step_s, model.predict(scored + 1) - step_s)

    def estimate(self, r: Request) -> float:
        return self.prior if r.acceptance_estimate is None else r.acceptance_estimate

    def learn(self, r: Request, drafted: int, accepted: int) -> None:
        rate = accepted / drafted
        r.acceptance_estimate = (1 - EMA) * self.estimate(r) + EMA * rate
        self.prior = (1 - PRIOR_EMA) * self.prior + PRIOR_EMA * rate

    def rest(self, r: Request) -> None:
        """No draft verified: relax toward the prior, so drafting is retried once it may pay."""
        est = self.estimate(r)
        r.acceptance_estimate = est + IDLE_EMA * (self.prior - est)

    def draft_width(self, r: Request) -> int:
        # a tree's nodes would each need their own processed row: chains only
        return self.tree_width if r.sampling.greedy and not r.sampling.processes else 1

    @property
    def adaptive(self) -> bool:
        return self.tracker is not None

    @property
    def step_time(self) -> StepTimeModel | None:
        return self.tracker.model if self.tracker is not None else None

    def observe(self, seqs: int, tokens: int, seconds: float, in_rounds_s: float = 0.0) -> None:
        if self.tracker is not None:
            target_s = seconds - in_rounds_s
            self.tracker.observe(tokens, target_s)
            self.draft_cost.observe(seqs, tokens - seqs, target_s)

    def held(self, r: Request) -> bool:
        """Whether ``r`` drafts its full cap every step (client-seeded, sampled, with a
        ``step_dependent`` drafter), so its tokens do not depend on the batch."""
        return self.step_dependent and r.sampling.seeded and not r.sampling.greedy

    def choose(
        self, reqs: Sequence[Request], caps: Sequence[int], fixed_tokens: int, budget: int
    ) -> list[int]:
        caps = [min(c, self.k_max) for c in caps]
        held = [self.held(r) for r in reqs]
        if not any(held):
            return self._choose(reqs, caps, fixed_tokens, budget, len(reqs), 0)
        free = [i for i, h in enumerate(held) if not h]
        taken = sum(1 + caps[i] for i, h in enumerate(held) if h)
        got = self._choose(
            [reqs[i] for i in free],
            [caps[i] for i in free],
            fixed_tokens + taken,
            budget - taken,
            len(reqs),
            max(c for c, h in zip(caps, held, strict=True) if h),  # rounds they draft anyway
        )
        out = list(caps)
        for i, k in zip(free, got, strict=True):
            out[i] = k
        return out

    def _choose(
        self,
        reqs: Sequence[Request],
        caps: Sequence[int],
        fixed_tokens: int,
        budget: int,
        seqs: int,
        paid_rounds: int,
    ) -> list[int]:
        if not reqs:
            return []
        costs = [self.draft_width(r) for r in reqs]
        if self.tracker is None:
            out, left = [], budget - len(reqs)
            for c, w in zip(caps, costs, strict=True):
                k = max(0, min(c, left // w))
                out.append(k)
                left -= k * w
            return out
        alphas = [self.estimate(r) for r in reqs]
        per_draft = self.draft_cost.per_draft(seqs)
        d = self.drafter
        rounds = d.rounds if d is not None else None
        round_s = rounds.round_s if rounds is not None else 0.0
        payers = [d.pays_rounds(r) for r in reqs] if d is not None and round_s > 0 else None
        return choose_ks(
            DraftBatch(alphas, caps, costs, payers),
            StepCosts(self.tracker.model, budget, fixed_tokens, per_draft, round_s, paid_rounds),
            TpotGuard(self.tpot_slo_s, self.tpot_slo_max_loss),
        )


def build_speculation(
    cfg: DecodeEngineConfig, drafter: Drafter, target: ModelRunner, allocator: BlockAllocator
) -> SpeculationPolicy:
    d = cfg.draft
    held = drafter.step_dependent
    alarm = AcceptanceAlarm(cfg.acceptance_alarm_ratio, cfg.acceptance_alarm_window_tokens)
    if not d.adaptive:
        return SpeculationPolicy(
            d.num_speculative_tokens, None, held, d.tree_width, drafter, alarm=alarm
        )
    shapes = calibration_points(
        min(cfg.max_batch_size, 32),
        d.num_speculative_tokens + 1,
        min(cfg.max_num_batched_tokens, 256),
    )
    t = cfg.target
    key = (
        f"v{METHOD}-{t.fingerprint()}-{t.dtype}-{cfg.device}-tp{cfg.tp_size}"
        f"-t{torch.get_num_threads()}-{shapes}"
    )
    path = (
        default_cache_dir() / "steptime" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
    )
    model = cached_step_time(
        path,
        lambda: measure_step_time(target, allocator, cfg.block_size, shapes, device=cfg.device),
    )
    return SpeculationPolicy(
        d.num_speculative_tokens,
        model,
        held,
        d.tree_width,
        drafter,
        cfg.speculation_tpot_slo_s,
        cfg.speculation_tpot_slo_max_loss,
        alarm,
    )
