"""The decode engine: admission, KV pulls, continuous batching, preemption, completion.

Requests arrive with a ``KVHandoff`` (disaggregated: their prompt's KV is pulled from a prefill
replica) or without one (colocated; or a request resumed after preemption): the engine then
computes the known tokens itself, in chunks. Either way the scheduler only looks at counters —
tokens known versus tokens whose KV is computed — never at phase flags. Each step takes running
requests first come, first served, within ``max_batch_size`` sequences and
``max_num_batched_tokens`` tokens (a decode costs ``1 + k`` tokens). When the pool cannot hold a
step's KV, the newest running request is preempted: its blocks are freed and it waits at the
head of the queue to be recomputed; per-position seeded sampling makes its output unchanged.

A request with ``n`` > 1 choices brings (or computes) its prompt once: its further choices wait
until the prompt's KV is there, then start as sequences of their own that share its full
prompt blocks (reference-counted, copy-on-write at block granularity: no sequence ever writes a
shared block) and compute only the prompt's last partial block themselves, sampling their
first token with their own seed (``_start_choices``).

Not thread-safe: one thread (``decode.loop.EngineLoop``) drives ``add``, ``abort`` and ``step``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

from decode.config import DecodeEngineConfig
from decode.drafters.base import Drafter
from decode.drafters.build import build_drafter
from decode.intake import KVIntake
from decode.outputs import EngineStats, SpecUsage, StepOutput
from decode.scheduler import Scheduler
from decode.spec_step import Emission, decode_step
from decode.speculation import build_speculation
from kvtransfer.allocator import BlockAllocator
from kvtransfer.handoff import KVCompatError, KVHandoff, check_compat, kv_compat
from kvtransfer.metrics import TransferObserver
from models.logprobs import TokenLogprob
from models.request import FinishReason, Request, RequestStatus
from runtime.build import build_shard
from runtime.shard import BucketSpec, ShardSpec
from speculation.calibration import DEFAULT_ACCEPTANCE
from speculation.routing_stats import (
    ReplicaLoad,
    RoutingStats,
    SpeculationState,
    collect_routing_stats,
)

log = logging.getLogger(__name__)


class DecodeEngine:
    def __init__(self, cfg: DecodeEngineConfig, observer: TransferObserver | None = None) -> None:
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
                buckets=BucketSpec(
                    max_seqs=cfg.max_batch_size,
                    max_query=cfg.draft.num_speculative_tokens + 1,
                    max_blocks=math.ceil(cfg.max_model_len / cfg.block_size),
                    # graphs over TP ranks would capture their NCCL all-reduces, which no GPU
                    # has checked yet: a TP group runs its buckets eagerly
                    graphs=cfg.device.startswith("cuda") and cfg.tp_size == 1,
                )
                if cfg.bucketed()
                else None,
            )
        )
        self.pool = self.shard.pool
        self.target = self.shard.target
        self.transport = self.shard.transport
        self.drafter: Drafter | None = build_drafter(cfg.draft, self.shard.draft)
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.compat = kv_compat(
            cfg.target, cfg.block_size, cfg.tp_size, cfg.draft.identity(), self.transport.name
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
        self.intake = KVIntake(self.transport, cfg.pull_margin_s, cfg.pull_timeout_s, observer)
        # queued requests, with their handoff and the time.monotonic() by which its lease ends
        self.waiting: deque[tuple[Request, KVHandoff | None, float]] = deque()
        self._queued_at: dict[str, float] = {}  # request id -> when it was queued (monotonic)
        self.queue_times: deque[float] = deque()  # drained by take_queue_times
        self.running: dict[str, Request] = {}
        # request id -> its further choices (n > 1), not started until its prompt's KV is here
        self._choices: dict[str, list[Request]] = {}
        # requests whose own output ended before decode (prefill's first token finished it):
        # they only bring their prompt's KV for their further choices, and end quietly
        self._sources: set[str] = set()
        self._outbox: list[StepOutput] = []
        # counters (stats)
        self.target_tokens_fed = 0
        self.steps = 0
        self.preemptions = 0
        self.recomputed = 0
        self.stalled = 0  # requests ended for preemption without progress
        self.handoffs = 0  # handoffs whose pull ended (landed or failed)
        self.handoffs_ok = 0  # of those, the ones that landed
        # the latest kv_health_window handoffs: True where the pull failed
        self._recent_failed: deque[bool] = deque(maxlen=cfg.kv_health_window)

    # ---- requests in and out -------------------------------------------------------------

    def add(self, req: Request, handoff: KVHandoff | None) -> None:
        """Queue a request; its outputs (or its error) come out of later ``step`` calls."""
        if handoff is not None:
            try:
                check_compat(self.compat, handoff.compat)
            except KVCompatError as e:  # a failed handoff too (/health's failed share)
                self._handoff_ended(failed=True)
                self._finish(req, FinishReason.ERROR, str(e))
                return
        most = self._most_tokens(req)
        if self._blocks_for(most) > self.cfg.num_blocks:
            capacity = self.cfg.num_blocks * self.cfg.block_size
            self._finish(
                req,
                FinishReason.ERROR,
                f"the prompt ({len(req.prompt_token_ids)} tokens) and max_tokens "
                f"({req.sampling.max_tokens}) need {most} tokens of KV; one sequence can hold "
                f"at most {capacity} in this pool (decode.num_blocks x kv.block_size)",
            )
            return
        if req.sampling.n > 1:
            self._choices[req.request_id] = req.choices()
            if handoff is not None:  # prefill's first token may have ended choice 0 already
                done = handoff.finish_reason is not None
            else:  # a resent request brings that first token itself
                done = bool(req.output_token_ids) and bool(
                    self._ended(req, req.output_token_ids[-1])
                )
            if done:
                self._sources.add(req.request_id)
        req.status = RequestStatus.WAITING
        lease_end = time.monotonic() + (handoff.lease_seconds if handoff else 0.0)
        self.waiting.append((req, handoff, lease_end))
        self._queued_at[req.request_id] = time.monotonic()

    def take_queue_times(self) -> list[float]:
        """Seconds each request admitted since the last call waited in this replica's queue
        (its first admission only; thread-safe against the engine thread)."""
        out = []
        while self.queue_times:
            out.append(self.queue_times.popleft())
        return out

    def abort(self, request_id: str) -> None:
        """End a request, and its further choices that have not started (started ones are
        sequences of their own, aborted by their own ids: ``models.request.choice_id``)."""
        self._queued_at.pop(request_id, None)
        self._choices.pop(request_id, None)
        self._sources.discard(request_id)
        for i, (req, _, _) in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                return
        if self.intake.cancel(request_id):
            return  # its blocks are freed once the read has ended (``step``)
        running = self.running.pop(request_id, None)
        if running is not None:
            self._release(running)

    @property
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.intake.pending
            or self.intake.cancelled
            or self.intake.quarantine
            or self.running
            or self._outbox
        )

    @property
    def only_waiting_on_pulls(self) -> bool:
        """Nothing to compute, only transfers to watch (the loop then polls gently)."""
        return not (self.running or self._outbox or self.waiting)

    def stats(self) -> EngineStats:
        """The engine's counters (a copy: another thread may take it while this one steps)."""
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
        )

    def routing_stats(self) -> RoutingStats:
        """The router's view of this replica: its load, each batched request's acceptance
        estimate and the k the speculation policy would give it now, the step-time model, the
        draft-token and draft-round costs, and the acceptance calibration learned from finished
        requests. Only copies, so another thread may take it while this one steps."""
        running = tuple(self.running.values())
        batch = running[: self.cfg.max_batch_size]
        load = ReplicaLoad(
            queued=len(self.waiting) + len(self.intake.pending) + len(running) - len(batch),
            free_blocks=self.allocator.num_free,
            num_blocks=self.cfg.num_blocks,
            block_size=self.cfg.block_size,
            max_batch_size=self.cfg.max_batch_size,
        )
        spec = self.speculation
        if spec is None:
            state = SpeculationState(k_max=0, adaptive=False, step_time=None)
            return collect_routing_stats(
                [DEFAULT_ACCEPTANCE] * len(batch), [0] * len(batch), load, state
            )
        ks = spec.choose(batch, [spec.k_max] * len(batch), 0, self.cfg.max_num_batched_tokens)
        rounds = self.drafter.rounds if self.drafter is not None else None
        state = SpeculationState(
            k_max=spec.k_max,
            adaptive=spec.adaptive,
            step_time=spec.step_time,
            draft_round_s=rounds.round_s if rounds is not None else 0.0,
            draft_token_s=spec.draft_cost.per_draft(len(batch) + 1) or 0.0,
            calibration=spec.calibration.cells(),
            tree_width=spec.tree_width,
        )
        alphas = [spec.estimate(r) for r in batch]
        return collect_routing_stats(alphas, ks, load, state, [spec.draft_width(r) for r in batch])

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self.transport.progress()
        cancelled, unquarantined = self.intake.settled()
        for r in cancelled:  # cancelled mid-pull: blocks it still holds are safe to reuse
            self._release(r)
        if unquarantined:  # reads the transport has now released on every rank
            self.allocator.free(unquarantined)
        self._admit()
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
            if req.request_id in self._sources:  # its own output ended on prefill
                self._end_source(req)
        plan = self.scheduler.plan(list(self.running.values()), self._preempt)
        if plan:
            reqs = [p.req for p in plan]
            t0 = time.perf_counter()
            emissions = decode_step(
                self.target, self.drafter, reqs, [p.new_tokens for p in plan], [p.k for p in plan]
            )
            seconds = time.perf_counter() - t0
            rounds = self.drafter.rounds if self.drafter is not None else None
            in_rounds = rounds.take_spent() if rounds is not None else 0.0
            if self.speculation is not None and all(p.new_tokens == 1 for p in plan):
                # decode steps only: the model prices drafts, and a prompt chunk's tokens cost
                # less each than one token of each of many sequences
                fed = sum(em.num_fed for em in emissions)
                self.speculation.observe(len(plan), fed, seconds, in_rounds)
            self.steps += 1
            for r, em in zip(reqs, emissions, strict=True):
                self.target_tokens_fed += em.num_fed
                if em.tokens:
                    self._apply(r, em)
        for rid in [rid for rid in self._choices if self._prompt_shared(rid)]:
            self._start_choices(self.running[rid])
        out, self._outbox = self._outbox, []
        return out

    # ---- a request's further choices (n > 1) ----------------------------------------------

    def _shared_prefix(self, r: Request) -> int:
        """Tokens of ``r``'s prompt whose KV its further choices can share: whole blocks that
        every KV group has computed, and never the prompt's last token (a choice computes that
        itself, to sample its own first token; an EAGLE head's slot t also holds token t + 1)."""
        done = r.num_computed
        if self.drafter is not None and self.drafter.uses_kv:
            done = min(done, r.num_draft_computed)
        done = min(done, len(r.prompt_token_ids) - 1, len(r.block_table) * self.cfg.block_size)
        return done // self.cfg.block_size * self.cfg.block_size

    def _prompt_shared(self, request_id: str) -> bool:
        """Whether the request's choices can start now: the prompt's KV is computed and every KV
        group holds all of it that can be shared, or a decode step has passed since (a drafter
        that lags, e.g. granted no drafts, then shares less rather than holding them back)."""
        r = self.running.get(request_id)
        if r is None or r.num_computed < len(r.prompt_token_ids):
            return False
        most = (len(r.prompt_token_ids) - 1) // self.cfg.block_size * self.cfg.block_size
        return self._shared_prefix(r) == most or len(r.output_token_ids) > 1

    def _start_choices(self, r: Request) -> None:
        """Start ``r``'s further choices: each holds a reference to the shared prompt blocks and
        computes the rest of the prompt into blocks of its own (the scheduler allocates them)."""
        choices = self._choices.pop(r.request_id, [])
        shared = self._shared_prefix(r)
        blocks = r.block_table[: shared // self.cfg.block_size]
        for c in choices:
            self.allocator.fork(blocks)
            c.block_table = list(blocks)
            c.num_computed = c.num_draft_computed = shared
            c.acceptance_probe = c.acceptance_estimate = r.acceptance_probe
            c.status = RequestStatus.RUNNING
            self._run(c)

    def _end_source(self, r: Request) -> None:
        """``r``'s own output ended before decode: start its choices on its KV, then end it
        with no new token (its stream then counts it finished; the ingress has its tokens)."""
        self._sources.discard(r.request_id)
        self._start_choices(r)
        self.running.pop(r.request_id, None)
        self._finish(r, self._ended(r, r.output_token_ids[-1]) or FinishReason.LENGTH, None)

    def _ended(self, r: Request, last: int) -> FinishReason | None:
        """Why ``r`` ends with ``last`` its newest output token (None: it goes on)."""
        if last in r.sampling.stop_token_ids:
            return FinishReason.STOP
        if (
            len(r.output_token_ids) >= r.sampling.max_tokens
            or r.num_tokens >= self.cfg.max_model_len
        ):
            return FinishReason.LENGTH
        return None

    def _apply(self, r: Request, em: Emission) -> None:
        if r.request_id in self._sources:  # its prompt is computed: only its choices go on
            self._end_source(r)
            return
        if em.num_drafted:
            r.stats.num_steps += 1
            r.stats.num_draft_tokens += em.num_drafted
            r.stats.num_accepted_tokens += em.num_accepted
            r.stats.num_emitted_tokens += len(em.tokens)
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
        else:
            if decoding and not em.num_drafted and self.speculation is not None:
                self.speculation.rest(r)  # it goes on, having verified nothing this step
            self._outbox.append(
                StepOutput(
                    r.request_id,
                    tuple(new),
                    None,
                    self._usage(r),
                    step_drafted=em.num_drafted,
                    step_accepted=em.num_accepted,
                    logprobs=logprobs,
                )
            )

    # ---- admission and preemption --------------------------------------------------------

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.cfg.block_size)

    def _most_tokens(self, r: Request) -> int:
        """The most KV slots ``r`` can ever need: its prompt and every output it may produce
        (drafts are capped to that room, so verification never needs more)."""
        return min(len(r.prompt_token_ids) + r.sampling.max_tokens, self.cfg.max_model_len) + 1

    def _admit(self) -> None:
        while self.waiting:
            req, handoff, lease_end = self.waiting[0]
            tokens = handoff.num_tokens if handoff else req.num_tokens
            need = self._blocks_for(tokens + 1)
            if req.stalled_preemptions > 1 and self.running:
                # preempted again before it could produce a token: recomputing it into the room
                # the others leave would only repeat that; it waits for room to finish
                need = max(need, self._blocks_for(self._most_tokens(req)))
            if not self.allocator.can_allocate(need):
                return  # first come, first served: wait for blocks to free up
            self.waiting.popleft()
            queued = self._queued_at.pop(req.request_id, None)
            if queued is not None:
                self.queue_times.append(time.monotonic() - queued)
            req.block_table = self.allocator.allocate(need)
            if handoff is None:
                req.num_computed = req.num_draft_computed = 0
                req.status = RequestStatus.RUNNING
                self._run(req)
            else:
                try:
                    error = self.intake.start(req, handoff, lease_end)
                except Exception as e:  # never strand it: it is in no queue right now
                    log.exception("starting the KV pull of %s failed", req.request_id)
                    error = f"KV transfer failed: {e}"
                if error is not None:
                    self._kv_failed(req, handoff, error)

    def _run(self, r: Request) -> None:
        if r.outputs_at_preemption < 0:  # first run: progress is counted from here
            r.outputs_at_preemption = len(r.output_token_ids)
        self.running[r.request_id] = r
        if self.speculation is not None:
            self.speculation.start(r)

    def _kv_failed(self, r: Request, handoff: KVHandoff, error: str) -> None:
        """A pull failed (source gone, lease ended, timeout): per ``kv_failure_policy``,
        compute the prompt here instead — the first token, already sent, stays the first —
        or end the request with the error."""
        first = self.handoffs == self.handoffs_ok  # no pull has failed before
        self._handoff_ended(failed=True)
        recompute = self.cfg.kv_failure_policy == "recompute"
        if first:  # loud once; the rest are counted (/health, tandem_kv_recomputed)
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
        """Free a running request's KV; it waits at the head of the queue to be recomputed.

        A request preempted ``max_stalled_preemptions`` times in a row without producing a
        token (since it started running, then since each preemption) cannot make progress in
        this pool beside the others (it would be recomputed and preempted again and again,
        holding up the queue behind it): it ends with an error instead."""
        self.running.pop(r.request_id)
        self.preemptions += 1
        outputs = len(r.output_token_ids)
        stalled = outputs == r.outputs_at_preemption  # no token since it was last preempted
        r.stalled_preemptions = r.stalled_preemptions + 1 if stalled else 0
        r.outputs_at_preemption = outputs
        if r.stalled_preemptions >= self.cfg.max_stalled_preemptions:
            self.stalled += 1
            self._finish(
                r,
                FinishReason.ERROR,
                f"preempted {r.stalled_preemptions} time{'s' * (r.stalled_preemptions > 1)} "
                "in a row without producing a token "
                f"(decode.max_stalled_preemptions): the KV pool ({self.cfg.num_blocks} blocks "
                f"of {self.cfg.block_size} tokens, decode.num_blocks) cannot hold its "
                f"{r.num_tokens} tokens beside the running requests",
            )
            return
        self._requeue(r)

    def _requeue(self, r: Request) -> None:
        """Drop ``r``'s KV (and its drafter state); it waits at the head of the queue to have
        all its known tokens computed here."""
        self.allocator.free(r.block_table)
        r.block_table = []
        r.num_computed = r.num_draft_computed = 0
        r.kv_moves = ()
        r.status = RequestStatus.WAITING
        if self.drafter is not None:
            self.drafter.forget(r.request_id)
        self.waiting.appendleft((r, None, 0.0))

    # ---- completion ----------------------------------------------------------------------

    def _usage(self, r: Request) -> SpecUsage:
        s = r.stats
        return SpecUsage(
            s.num_steps, s.num_draft_tokens, s.num_accepted_tokens, s.num_emitted_tokens
        )

    def _release(self, r: Request) -> None:
        if self.drafter is not None:
            self.drafter.forget(r.request_id)
        if r.block_table:
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
        if r.request_id in self._choices:  # its choices go on without it, or fail with it
            if reason is FinishReason.ERROR:
                for c in self._choices.pop(r.request_id):
                    self._finish(c, reason, error)
            else:
                self._start_choices(r)
        self._sources.discard(r.request_id)
        self._release(r)
        if self.speculation is not None and reason is not FinishReason.ERROR:
            self.speculation.finished(r)
        drafted, accepted = (em.num_drafted, em.num_accepted) if em else (0, 0)
        self._outbox.append(
            StepOutput(
                r.request_id,
                new,
                reason.value,
                self._usage(r),
                error,
                drafted,
                accepted,
                logprobs,
            )
        )

    def close(self) -> None:
        self.shard.close()
