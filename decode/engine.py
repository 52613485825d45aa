"""The decode engine. Scheduling reads counters (tokens known vs. KV computed), never phase flags,
so pulled, colocated and preempted (recomputed; per-position seeds keep its output) requests run
alike. Not thread-safe: one thread (``decode.loop.EngineLoop``) drives it."""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from decode.admission import Admission, Queued
from decode.choices import Choices
from decode.config import DecodeEngineConfig
from decode.drafters.base import Drafter
from decode.drafters.build import build_drafter
from decode.flight import UNREAD, Flight, goes_on_unread
from decode.intake import KVIntake
from decode.outputs import EngineStats, SpecUsage, StepOutput
from decode.routing_view import routing_stats
from decode.scheduler import Planned, Scheduler
from decode.spec_step import Emission, decode_step, land_step, launch_step
from decode.speculation import build_speculation
from kvtransfer.allocator import BlockAllocator
from kvtransfer.handoff import KVCompatError, KVHandoff, check_compat, kv_compat
from kvtransfer.metrics import TransferObserver
from kvtransfer.tp_transport import RankTimeoutError
from models.logprobs import TokenLogprob
from models.request import FinishReason, Request, RequestStatus
from runtime.bucketed import BucketedRunner
from runtime.bucketed_eagle import BucketedEagleRunner
from runtime.build import build_shard
from runtime.runner import synchronize
from runtime.shard import BucketSpec, ShardSpec
from runtime.warm_up import WarmUp, warm_grid, warm_up
from serving.grammars import ReplicaGrammars
from speculation.draft_stop import DraftStop
from speculation.loop_cycle import CycleOverhead
from speculation.routing_stats import RoutingStats

log = logging.getLogger(__name__)
PULL_WAIT_S = 0.0005
BLOCKED_WAIT_S = 0.02


class DecodeEngine:
    def __init__(self, cfg: DecodeEngineConfig, observer: TransferObserver | None = None) -> None:
        # no sequence outgrows the pool (its floor, when sized from memory): a model's 128k
        # context would otherwise size every step's block-table copy (4 MiB at 64 sequences)
        cfg = replace(cfg, max_model_len=min(cfg.max_model_len, cfg.num_blocks * cfg.block_size))
        self.cfg = cfg
        self.shard = build_shard(
            ShardSpec(
                role="decode",
                target=cfg.target,
                draft=cfg.draft,
                num_blocks=cfg.num_blocks,
                block_size=cfg.block_size,
                device=cfg.device,
                tp_size=cfg.tp_size,
                num_threads=cfg.num_threads,
                switch_interval_s=cfg.switch_interval_s,
                transport=cfg.transport,
                fabric=cfg.kv_fabric,
                path_check=cfg.path_check,
                min_path_gbps=cfg.min_path_gbps,
                buckets=BucketSpec(
                    max_seqs=cfg.max_batch_size,
                    max_query=cfg.draft.num_speculative_tokens + 1,
                    max_blocks=math.ceil(cfg.max_model_len / cfg.block_size),
                    # under TP each rank captures its shard, NCCL all-reduces inside
                    graphs=cfg.device.startswith("cuda"),
                )
                if cfg.bucketed()
                else None,
                memory_utilization=cfg.gpu_memory_utilization,
                profile_tokens=cfg.max_num_batched_tokens,
                profile_seqs=cfg.max_batch_size,
                profile_query=cfg.draft.num_speculative_tokens + 1,
            )
        )
        # sized from memory: what the pool holds, from here on
        self.cfg = cfg = replace(cfg, num_blocks=self.shard.pool.spec.num_blocks)
        self.pool = self.shard.pool
        self.target = self.shard.target
        self.warmed: WarmUp | None = None  # before any block is handed out: it writes the pool
        bucketed = self.target.rank0()
        self.bucketed = bucketed if isinstance(bucketed, BucketedRunner) else None
        draft = self.shard.draft
        # a drafter's chain rounds: captured and compiled at start-up like the target's steps
        self.draft_bucketed = (
            draft if isinstance(draft, (BucketedRunner, BucketedEagleRunner)) else None
        )
        if self.bucketed is not None and cfg.warms_up():
            self.warmed = warm_up(self.target, self.bucketed)
            if isinstance(draft, BucketedRunner):
                self.warmed = self.warmed.plus(warm_up(draft, draft))
            elif isinstance(draft, BucketedEagleRunner):
                self.warmed = self.warmed.plus(warm_grid(draft, draft.warm, "EAGLE head"))
        self.transport = self.shard.transport
        self.drafter: Drafter | None = build_drafter(cfg.draft, self.shard.draft)
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.compat = kv_compat(
            cfg.target, cfg.block_size, cfg.tp_size, cfg.draft.identity(), self.transport.wire
        )
        self.speculation = (
            build_speculation(cfg, self.drafter, self.target, self.allocator)
            if self.drafter is not None
            else None
        )
        self.scheduler = Scheduler(
            self.allocator,
            cfg.block_size,
            cfg.max_batch_size,
            cfg.max_num_batched_tokens,
            cfg.max_model_len,
            self.speculation,
        )
        self.admission = Admission(
            self.allocator,
            cfg.num_blocks,
            cfg.block_size,
            cfg.max_model_len,
            cfg.max_stalled_preemptions,
        )
        self.intake = KVIntake(
            self.transport,
            cfg.pull_margin_s,
            cfg.pull_timeout_s,
            observer,
            quarantine_s=cfg.quarantine_timeout_s,
        )
        drafter_kv = self.drafter is not None and self.drafter.uses_kv
        self.choices = Choices(self.allocator, cfg.block_size, drafter_kv)
        self.grammars = ReplicaGrammars(cfg.target)
        self.running: dict[str, Request] = {}
        self._outbox: list[StepOutput] = []
        self.target_tokens_fed = 0
        self.steps = 0
        self.last_step_s = 0.0  # the last step's forwards and draft rounds (0: none ran)
        self.cycle = CycleOverhead()
        self.draft_stop = DraftStop() if cfg.draft.early_stop else None
        self.preemptions = 0
        self.recomputed = 0
        self.stalled = 0
        self.handoffs = 0
        self.handoffs_ok = 0
        self.step_failures = 0
        self.queue_timeouts = 0
        self.suspects: set[str] = set()  # requests of a failed batch, to run alone once each
        # on a GPU the intake runs while the device computes a step (on a CPU the step has
        # finished by then: nothing to overlap)
        self.intake_beside_step = cfg.device.startswith("cuda")
        self._beside_error: Exception | None = None
        self.overlap = self._overlaps(cfg)
        self._flight: Flight | None = None  # overlap: the step in the air, launched, unread
        self.steps_overlapped = 0
        self._recent_failed: deque[bool] = deque(maxlen=cfg.kv_health_window)
        for runner in (self.bucketed, self.draft_bucketed):  # after the calibration's steps
            if runner is not None:
                runner.serving()

    def during_traffic(self) -> tuple[int, int]:
        """(compiles, captures) live steps waited on: the target's and its drafter's."""
        runners = [r for r in (self.bucketed, self.draft_bucketed) if r is not None]
        late = [r.during_traffic() for r in runners]
        return sum(c for c, _ in late), sum(g for _, g in late)

    def add(self, req: Request, handoff: KVHandoff | None) -> None:
        if handoff is not None:
            try:
                check_compat(self.compat, handoff.compat)
            except KVCompatError as e:
                self._handoff_ended(failed=True)
                self._finish(req, FinishReason.ERROR, str(e))
                return
        try:  # a no-op when the server prepared it off this thread, as it does
            self.grammars.attach(req)
        except ValueError as e:
            self._finish(req, FinishReason.ERROR, f"invalid grammar: {e}")
            return
        refused = self.admission.refusal(req)
        if refused is not None:
            self._finish(req, FinishReason.ERROR, refused)
            return
        if req.sampling.n > 1:
            self.choices.hold(req, source=self._ended_before_decode(req, handoff))
        self.admission.add(req, handoff)

    def abort(self, request_id: str) -> None:
        """End a request and its choices not yet started (started ones have ids of their own)."""
        self.choices.drop(request_id)
        if self.admission.remove(request_id):
            return
        if self.intake.cancel(request_id):
            return  # its blocks are freed once the read has ended (``step``)
        running = self.running.pop(request_id, None)
        if running is not None:
            self._release(running)

    @property
    def waiting(self) -> deque[Queued]:
        return self.admission.waiting

    def take_queue_times(self) -> list[float]:
        return self.admission.take_queue_times()

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.intake.pending
            or self.intake.cancelled
            or self.intake.quarantine
            or self.running
            or self._outbox
            or self._flight is not None
        )

    @property
    def idle_wait_s(self) -> float:
        """How long the loop may wait for a command before stepping: 0 while a step has work,
        a little while reads land, longer when only blocks held elsewhere can free."""
        if self.running or self._outbox or self._flight is not None:
            return 0.0
        if self.admission.head_fits(others_running=False):
            return 0.0
        if self.intake.pending or self.intake.cancelled:
            return PULL_WAIT_S
        return BLOCKED_WAIT_S  # queued for blocks or quarantined reads: nothing computes

    def stats(self) -> EngineStats:
        return EngineStats(
            num_blocks=self.cfg.num_blocks,
            free_blocks=self.allocator.num_free,
            waiting=len(self.waiting),
            pulling=len(self.intake.pending),
            running=len(self.running),
            target_tokens_fed=self.target_tokens_fed,
            draft_tokens_fed=self.drafter.tokens_fed if self.drafter else 0,
            steps=self.steps,
            preemptions=self.preemptions,
            kv_recomputed=self.recomputed,
            stalled=self.stalled,
            kv_handoffs=self.handoffs,
            kv_recent_handoffs=len(self._recent_failed),
            kv_recent_failed=sum(self._recent_failed),
            quarantined_blocks=self.intake.quarantined_blocks,
            retired_blocks=self.intake.retired_blocks,
            queue_timeouts=self.queue_timeouts,
            step_failures=self.step_failures,
            steps_overlapped=self.steps_overlapped,
        )

    def routing_stats(self) -> RoutingStats:
        """Copies only: another thread may take it while this one steps."""
        queued = len(self.waiting) + len(self.intake.pending)
        running = tuple(self.running.values())
        return routing_stats(
            self.cfg,
            running,
            queued,
            self.allocator.num_free,
            self.speculation,
            self.drafter,
            self.cycle.seconds,
        )

    def observe_cycle(self, cycle_s: float) -> None:
        """The loop's wall time from the last step's start to this one's (both busy)."""
        self.cycle.observe(cycle_s, self.last_step_s)

    def _overlaps(self, cfg: DecodeEngineConfig) -> bool:
        if not cfg.overlaps():
            return False
        why = None
        if self.drafter is not None:
            why = "a drafter's steps need their tokens on the host before the next is planned"
        elif not self.target.takes_device_ids:
            why = f"{type(self.target).__name__} takes its steps' tokens from the host"
        if why is not None:
            log.log(
                logging.WARNING if cfg.overlap == "on" else logging.INFO,
                "decode.overlap off: %s",
                why,
            )
        return why is None

    def step(self) -> list[StepOutput]:
        self.last_step_s = 0.0
        self._intake()
        if self.overlap:
            self._step_ahead()
        else:
            plan = self.scheduler.plan(self._schedulable(), self._preempt)
            for p, em in zip(plan, self._isolated_step(plan), strict=True):
                if em.tokens:
                    self._apply(p.req, em)
        for r in self.choices.ready(self.running):
            self._start_choices(r)
        out, self._outbox = self._outbox, []
        if self._beside_error is not None:  # the intake beside the step failed: after it
            e, self._beside_error = self._beside_error, None
            raise e
        return out

    def _intake(self) -> None:
        """Transfers settled, queued requests admitted and landed KV pulls started running."""
        self._settle_transfers()
        self._admit()
        self._land_pulls()

    def _intake_beside(self) -> None:
        """The intake while the device runs a step (the next step's start runs it again, for
        what the step's finished requests free); its error is raised after the step."""
        try:
            self._intake()
        except Exception as e:
            self._beside_error = e

    def _settle_transfers(self) -> None:
        self.transport.progress()
        cancelled, unquarantined = self.intake.settled()
        for r in cancelled:
            self._release(r)
        if unquarantined:
            self.allocator.free(unquarantined)
        self.admission.num_blocks = self.cfg.num_blocks - self.intake.retired_blocks
        limit = self.cfg.max_queue_wait_s
        for r in self.admission.overdue(time.monotonic(), limit):
            self.queue_timeouts += 1
            self._finish(
                r,
                FinishReason.ERROR,
                f"waited more than {limit:g} s for KV blocks on its decode replica "
                "(decode.max_queue_wait_s); retry shortly",
            )

    def _admit(self) -> None:
        while (q := self.admission.next(others_running=bool(self.running))) is not None:
            req, handoff = q.req, q.handoff
            if handoff is None:
                req.num_computed = req.num_draft_computed = 0
                req.status = RequestStatus.RUNNING
                self._run(req)
                continue
            try:
                error = self.intake.start(req, handoff, q.lease_end)
            except RankTimeoutError:  # the replica's fault, not the request's: it is wedged
                self.admission.put_back(q)
                raise
            except Exception as e:  # never strand it: it is in no queue right now
                log.exception("starting the KV pull of %s failed", req.request_id)
                error = f"KV transfer failed: {e}"
            if error is not None:
                self._kv_failed(req, handoff, error)

    def _land_pulls(self) -> None:
        for req, handoff, error in self.intake.poll():
            if error is not None:
                self._kv_failed(req, handoff, error)
                continue
            self._handoff_ended(failed=False)
            if self.drafter is not None and self.drafter.needs_features:
                if handoff.hidden_state is None:
                    self._finish(req, FinishReason.ERROR, "the handoff lacks the drafter's feature")
                    continue
                self.drafter.observe(req, handoff.hidden_state.view(1, -1).to(self.pool.device))
            self._run(req)
            if self.choices.is_source(req.request_id):
                self._end_source(req)

    def _schedulable(self) -> list[Request]:
        """Every running request, or one suspect alone while a failed batch is bisected; not
        one whose step in the air emits its last token."""
        suspect = next((r for r in self.running.values() if r.request_id in self.suspects), None)
        if suspect is not None:
            return [suspect]
        f = self._flight
        if f is None:
            return list(self.running.values())
        return [r for r in self.running.values() if r.request_id not in f.at or self._room(r)]

    def _room(self, r: Request) -> bool:
        """Whether ``r`` may go on after its token in the air (ends known without reading it)."""
        return (
            len(r.output_token_ids) < r.sampling.max_tokens
            and r.num_tokens < self.cfg.max_model_len
        )

    def _step_ahead(self) -> None:
        """Overlapped: plan and launch step n + 1 while step n (launched by the last call) is
        in the air, then read step n. What step n ends is dropped from step n + 1's reading;
        step n + 1 stays in the air if every request in it may go on unread."""
        prev, self._flight = self._flight, None
        if prev is not None and (self.suspects or not self._room_beside()):
            self._land(prev)
            prev = None
        self._flight = prev  # beside it: what waits for its read is not scheduled
        plan = self.scheduler.plan(self._schedulable(), self._preempt)
        t0 = time.perf_counter()
        try:
            launched = self._launch(plan, prev)
        except Exception as e:
            if prev is None:
                self._step_failed(plan, e)
            else:
                self._ahead_failed([], plan, e)  # with the step in the air
            return
        self._flight = launched  # in the air while step n is read: what that read frees waits
        if prev is not None:
            self._land(prev)
        if launched is not None and self._flight is launched and not launched.ahead:
            self._flight = None  # some request in it needs its tokens before its next step
            self._land(launched)
        self.last_step_s = time.perf_counter() - t0

    def _room_beside(self) -> bool:
        """Planning beside a step in the air must not preempt: a preempted request is
        recomputed from its tokens, and the host has not read the last one yet. (Nor does it
        while a failed batch is bisected: a suspect runs alone.)"""
        bs = self.cfg.block_size
        need = sum(
            max(0, math.ceil(r.num_tokens / bs) - len(r.block_table)) for r in self.running.values()
        )
        return need <= self.allocator.num_free

    def _launch(self, plan: Sequence[Planned], prev: Flight | None) -> Flight | None:
        """Step ``plan`` queued on the device; its plain decodes of ``prev`` fed the tokens
        ``prev`` sampled, on the device. Each of its requests that may go on unread gets a
        placeholder token and its pending token counted computed."""
        if not plan:
            return None
        reqs = [p.req for p in plan]
        sampled = prev.launched.sampled() if prev is not None else {}
        fed = {
            r.request_id: sampled[r.request_id] for r in reqs if prev and r.request_id in prev.at
        }
        launched = launch_step(
            self.target, None, reqs, [p.new_tokens for p in plan], [p.k for p in plan], fed
        )
        self.steps += 1
        self.steps_overlapped += prev is not None
        self.target_tokens_fed += sum(s.num_fed for s in launched.steps)
        at: dict[str, int] = {}
        sources = {r.request_id for r in reqs if self.choices.is_source(r.request_id)}
        ahead = all(
            goes_on_unread(s, s.req.request_id in self.suspects, s.req.request_id in sources)
            for s in launched.steps
        )
        for s in launched.steps if ahead else ():
            if s.samples:  # its pending tokens are in the KV once the step has run
                r = s.req
                r.num_computed += len(s.pending)
                at[r.request_id] = len(r.output_token_ids)
                r.output_token_ids.append(UNREAD)
        return Flight(tuple(plan), launched, ahead, at)

    def _land(self, f: Flight) -> None:
        """Read ``f`` and apply its tokens; a request that ended or was aborted while it was
        in the air takes none. Its held blocks are freed after the read."""
        try:
            emissions = land_step(f.launched, advanced=f.ahead)
        except Exception as e:
            self._ahead_failed([f], [], e)
            return
        self.suspects.difference_update(
            p.req.request_id for p, em in zip(f.plan, emissions, strict=True) if em.tokens
        )
        for p, em in zip(f.plan, emissions, strict=True):
            r = p.req
            if self.running.get(r.request_id) is not r:
                continue
            later: list[int] = []
            if r.request_id in f.at:  # the placeholder (and one of the step now in the air) go
                at = f.at[r.request_id]
                later = r.output_token_ids[at + 1 :]
                del r.output_token_ids[at:]
            if em.tokens:
                self._apply(r, em)
            if later and self.running.get(r.request_id) is r:
                r.output_token_ids += later
        self.allocator.free(f.held)

    def _ahead_failed(
        self, flights: Sequence[Flight], plan: Sequence[Planned], e: Exception
    ) -> None:
        """A step failed with another in the air or planned on it: their requests fail as one
        batch, their placeholders gone, once the device has finished what it was given."""
        if self._flight is not None:
            flights = [*flights, self._flight]
            self._flight = None
        try:
            synchronize(self.cfg.device)
        except Exception:
            log.exception("waiting for the device after a failed step")
        failed: dict[str, Planned] = {}
        for f in flights:
            self.allocator.free(f.held)
            for p in f.plan:
                if p.req.request_id in f.at:
                    del p.req.output_token_ids[f.at[p.req.request_id] :]
        for p in [p for f in flights for p in f.plan] + list(plan):
            if self.running.get(p.req.request_id) is p.req:
                failed.setdefault(p.req.request_id, p)
        self._step_failed(list(failed.values()), e)

    def _isolated_step(self, plan: Sequence[Planned]) -> list[Emission]:
        """The step's emissions; a step that raises fails its request if it ran alone, else
        recomputes each of its requests alone (per-position seeds keep their tokens), so one
        request's fault ends that request only. Returns no emission for a failed step."""
        try:
            emissions = self._run_step(plan)
        except Exception as e:
            self._step_failed(plan, e)
            return [Emission((), 0, 0, 0) for _ in plan]
        # cleared once it emits: a fault may lie in sampling, after its prompt's recompute
        self.suspects.difference_update(
            p.req.request_id for p, em in zip(plan, emissions, strict=True) if em.tokens
        )
        return emissions

    def _step_failed(self, plan: Sequence[Planned], e: Exception) -> None:
        self.step_failures += 1
        if not plan:  # every request in it had ended or been aborted meanwhile
            log.warning("a step whose requests had all ended failed: %s", e)
            return
        if len(plan) == 1:
            r = plan[0].req
            log.exception("the decode step of request %s failed", r.request_id)
            self.running.pop(r.request_id, None)
            self._finish(r, FinishReason.ERROR, f"decode step failed for this request: {e}")
            return
        log.warning("a step of %d requests failed (%s): each runs alone", len(plan), e)
        for p in plan:
            self.running.pop(p.req.request_id)
            self.suspects.add(p.req.request_id)
            self._requeue(p.req)

    def _run_step(self, plan: Sequence[Planned]) -> list[Emission]:
        if not plan:
            return []
        reqs = [p.req for p in plan]
        if self.draft_stop is not None and self.speculation is not None and self.drafter:
            cutoff = self.speculation.stop_cutoff(reqs, [p.k for p in plan], self.draft_stop)
            self.drafter.stop_chains_below(cutoff)
        t0 = time.perf_counter()
        emissions = decode_step(
            self.target,
            self.drafter,
            reqs,
            [p.new_tokens for p in plan],
            [p.k for p in plan],
            self._intake_beside if self.intake_beside_step else None,
        )
        seconds = self.last_step_s = time.perf_counter() - t0
        rounds = self.drafter.rounds if self.drafter is not None else None
        in_rounds = rounds.take_spent() if rounds is not None else 0.0
        fed = sum(em.num_fed for em in emissions)
        if self.speculation is not None and all(p.new_tokens == 1 for p in plan):
            # decode steps only: a prompt chunk's tokens cost less each than decodes'
            self.speculation.observe(len(plan), fed, seconds, in_rounds)
        self.steps += 1
        self.target_tokens_fed += fed
        return emissions

    def _apply(self, r: Request, em: Emission) -> None:
        if self.choices.is_source(r.request_id):  # its prompt is computed: only its choices go on
            self._end_source(r)
            return
        if em.num_drafted:
            r.stats.record_step(em.num_drafted, em.num_accepted, len(em.tokens))
            if self.speculation is not None:
                self.speculation.learn(r, em.num_drafted, em.num_accepted)
        decoding = bool(r.output_token_ids)  # not the first token, which is never drafted
        new: list[int] = []
        reason: FinishReason | None = None
        for tok in em.tokens:
            r.output_token_ids.append(tok)
            new.append(tok)
            reason = self._ended(r, tok)
            if reason is not None:
                break
        logprobs = em.logprobs[: len(new)]
        if reason is not None:
            self.running.pop(r.request_id)
            self._finish(r, reason, None, tuple(new), em, logprobs)
            return
        if decoding and not em.num_drafted and self.speculation is not None:
            self.speculation.rest(r)
        self._outbox.append(
            StepOutput(
                r.request_id,
                tuple(new),
                None,
                _usage(r),
                step_drafted=em.num_drafted,
                step_accepted=em.num_accepted,
                logprobs=logprobs,
            )
        )

    def _ended(self, r: Request, last: int) -> FinishReason | None:
        if last in r.sampling.stop_token_ids:
            return FinishReason.STOP
        if r.grammar is not None:
            r.grammar.sync(r.output_token_ids)
            if r.grammar.stopped:  # complete: nothing but an end token could follow
                return FinishReason.STOP
        if (
            len(r.output_token_ids) >= r.sampling.max_tokens
            or r.num_tokens >= self.cfg.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _ended_before_decode(self, req: Request, handoff: KVHandoff | None) -> bool:
        if handoff is not None:
            return handoff.finish_reason is not None
        return bool(req.output_token_ids) and bool(self._ended(req, req.output_token_ids[-1]))

    def _start_choices(self, r: Request) -> None:
        for c in self.choices.start(r):
            self._run(c)

    def _end_source(self, r: Request) -> None:
        self._start_choices(r)
        self.running.pop(r.request_id, None)
        self._finish(r, self._ended(r, r.output_token_ids[-1]) or FinishReason.LENGTH, None)

    def _run(self, r: Request) -> None:
        if r.outputs_at_preemption < 0:  # first run: progress is counted from here
            r.outputs_at_preemption = len(r.output_token_ids)
        self.running[r.request_id] = r
        if self.speculation is not None:
            self.speculation.start(r)

    def _kv_failed(self, r: Request, handoff: KVHandoff, error: str) -> None:
        """Per ``kv_failure_policy``: recompute the prompt here, or end the request."""
        first = self.handoffs == self.handoffs_ok
        self._handoff_ended(failed=True)
        recompute = self.cfg.kv_failure_policy == "recompute"
        if first:
            log.error(
                "request %s: %s; %s. KV pulls that fail from now on are counted in /health "
                "(kv_recomputed, kv_failed_fraction) and the tandem_kv_failures metric and "
                "logged at debug level only",
                r.request_id,
                error,
                "recomputing its prompt on decode" if recompute else "ending it (fail policy)",
            )
        else:
            log.debug("request %s: %s", r.request_id, error)
        if not recompute:
            self._finish(r, FinishReason.ERROR, error)
            return
        self.recomputed += 1
        self.intake.observer.recomputed(self.transport.name)
        r.output_token_ids = [handoff.first_token]
        self._requeue(r)

    def _handoff_ended(self, failed: bool) -> None:
        self.handoffs += 1
        self.handoffs_ok += not failed
        self._recent_failed.append(failed)

    def _preempt(self, r: Request) -> None:
        self.running.pop(r.request_id)
        self.preemptions += 1
        error = self.admission.preempted(r)
        if error is not None:
            self.stalled += 1
            self._finish(r, FinishReason.ERROR, error)
            return
        self._requeue(r)

    def _requeue(self, r: Request) -> None:
        if self.drafter is not None:
            self.drafter.forget(r.request_id)
        self.admission.requeue(r)

    def _release(self, r: Request) -> None:
        self.suspects.discard(r.request_id)
        if self.drafter is not None:
            self.drafter.forget(r.request_id)
        if r.block_table:
            if self._flight is not None:  # the step in the air may still write them
                self._flight.held.extend(r.block_table)
            else:
                self.allocator.free(r.block_table)
            r.block_table = []
        r.status = RequestStatus.FINISHED

    def _finish(
        self,
        r: Request,
        reason: FinishReason,
        error: str | None,
        new: tuple[int, ...] = (),
        em: Emission | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        if error:
            log.warning("request %s failed: %s", r.request_id, error)
        r.finish_reason, r.error = reason, error
        if reason is FinishReason.ERROR:  # its choices not yet started fail with it
            for c in self.choices.drop(r.request_id):
                self._finish(c, reason, error)
        else:
            self._start_choices(r)
        self._release(r)
        if self.speculation is not None and reason is not FinishReason.ERROR:
            self.speculation.finished(r)
        drafted, accepted = (em.num_drafted, em.num_accepted) if em else (0, 0)
        self._outbox.append(
            StepOutput(
                r.request_id,
                new,
                reason.value,
                _usage(r),
                error,
                drafted,
                accepted,
                logprobs,
            )
        )

    def close(self) -> None:
        self.grammars.close()
        self.shard.close()


def _usage(r: Request) -> SpecUsage:
    s = r.stats
    return SpecUsage(
        s.num_steps,
        s.num_draft_tokens,
        s.num_accepted_tokens,
        s.num_emitted_tokens,
        tuple(s.histogram),
    )
