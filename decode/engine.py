"""The decode engine: admission, KV pulls, continuous batching and request completion.

Requests arrive with a ``KVHandoff`` (disaggregated: their prompt's KV is pulled from a prefill
replica) or without one (colocated, or recomputation): the engine then computes the prompt
itself. Either way the scheduler only looks at counters: tokens known versus tokens whose KV is
computed. Every step runs all running requests in one batch (up to ``max_batch_size``).

Not thread-safe: one thread (``decode.loop.EngineLoop``) drives ``add``, ``abort`` and ``step``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from decode.config import DecodeEngineConfig
from decode.drafters.base import Drafter
from decode.drafters.draft_model import DraftModelDrafter
from decode.drafters.ngram import NgramDrafter
from decode.outputs import SpecUsage, StepOutput
from decode.spec_step import Emission, decode_step
from kvtransfer.allocator import BlockAllocator
from kvtransfer.handoff import KVCompat, KVCompatError, KVHandoff, check_compat
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import KV_LAYOUT, KVPool, KVPoolSpec, group_spec
from kvtransfer.transport import KVTransferError, KVTransport, PullHandle, PullState
from models.request import FinishReason, Request, RequestStatus
from models.spec import DraftKind

log = logging.getLogger(__name__)
EMA = 0.2  # weight of the newest step in the online acceptance estimate


@dataclass(frozen=True)
class EngineStats:
    num_blocks: int
    free_blocks: int
    waiting: int
    pulling: int
    running: int
    target_tokens_fed: int  # tokens the target computed on this replica (prompts included)
    draft_tokens_fed: int  # tokens the draft model computed on this replica
    steps: int


class DecodeEngine:
    def __init__(self, cfg: DecodeEngineConfig) -> None:
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.target = cfg.target.load(cfg.device)
        tc = self.target.cfg
        groups = [
            group_spec("target", tc.num_layers, tc.num_kv_heads, tc.head_dim, cfg.target.dtype)
        ]
        draft_model = cfg.draft.model.load(cfg.device) if cfg.draft.model else None
        if draft_model is not None and cfg.draft.model is not None:
            dc = draft_model.cfg
            groups.append(
                group_spec(
                    "draft", dc.num_layers, dc.num_kv_heads, dc.head_dim, cfg.draft.model.dtype
                )
            )
        self.pool = KVPool(KVPoolSpec(cfg.num_blocks, cfg.block_size, tuple(groups)), cfg.device)
        self.drafter: Drafter | None = None
        if draft_model is not None:
            self.drafter = DraftModelDrafter(draft_model, self.pool.tensor("draft"), cfg.block_size)
        elif cfg.draft.kind is DraftKind.NGRAM:
            self.drafter = NgramDrafter(cfg.draft.ngram_max, cfg.draft.ngram_min)
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.transport: KVTransport = NixlTransport(self.pool, role="decode")
        self.compat = KVCompat(
            model=cfg.target.fingerprint(),
            dtype=cfg.target.dtype,
            block_size=cfg.block_size,
            kv_layout=KV_LAYOUT,
            tp_size=1,
            draft=cfg.draft.identity(),
        )
        self.waiting: deque[tuple[Request, KVHandoff | None]] = deque()
        self.pulling: dict[str, tuple[Request, KVHandoff, PullHandle]] = {}
        self.running: dict[str, Request] = {}
        self._outbox: list[StepOutput] = []
        self._target_fed = 0
        self._steps = 0

    # ---- requests in and out -------------------------------------------------------------

    def add(self, req: Request, handoff: KVHandoff | None) -> None:
        """Queue a request; its outputs (or its error) come out of later ``step`` calls."""
        if handoff is not None:
            try:
                check_compat(self.compat, handoff.compat)
            except KVCompatError as e:
                self._fail(req, str(e))
                return
        if req.num_tokens + 1 > self.cfg.num_blocks * self.cfg.block_size:
            self._fail(req, f"prompt of {req.num_tokens} tokens exceeds the decode KV pool")
            return
        req.status = RequestStatus.WAITING
        self.waiting.append((req, handoff))

    def abort(self, request_id: str) -> None:
        for i, (req, _) in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                return
        if request_id in self.pulling:
            req, _, pull = self.pulling.pop(request_id)
            # The read may still be landing in these blocks: wait for it to settle first.
            self.transport.wait(pull, timeout_s=5.0)
            self.transport.finish(pull)
            self._release(req)
        elif request_id in self.running:
            req = self.running.pop(request_id)
            self._release(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.pulling or self.running or self._outbox)

    @property
    def only_waiting_on_pulls(self) -> bool:
        return bool(self.pulling) and not (self.running or self._outbox)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_blocks=self.cfg.num_blocks,
            free_blocks=self.allocator.num_free,
            waiting=len(self.waiting),
            pulling=len(self.pulling),
            running=len(self.running),
            target_tokens_fed=self._target_fed,
            draft_tokens_fed=self.drafter.tokens_fed if self.drafter else 0,
            steps=self._steps,
        )

    # ---- the step ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        self._admit()
        self._poll_pulls()
        batch = list(self.running.values())[: self.cfg.max_batch_size]
        if batch:
            ks = [self._choose_k(r) for r in batch]
            ready = [self._reserve(r, k) for r, k in zip(batch, ks, strict=True)]
            reqs = [r for r, ok in zip(batch, ready, strict=True) if ok]
            ks = [k for k, ok in zip(ks, ready, strict=True) if ok]
            if reqs:
                emissions = decode_step(
                    self.target,
                    self.pool.tensor("target"),
                    self.cfg.block_size,
                    self.drafter,
                    reqs,
                    ks,
                )
                self._steps += 1
                for r, em in zip(reqs, emissions, strict=True):
                    self._target_fed += em.num_fed
                    self._apply(r, em)
        out, self._outbox = self._outbox, []
        return out

    def _choose_k(self, r: Request) -> int:
        if self.drafter is None or not r.output_token_ids or r.num_computed != r.num_tokens - 1:
            return 0
        room = min(
            r.sampling.max_tokens - len(r.output_token_ids),
            self.cfg.max_model_len - r.num_tokens,
        )
        return max(0, min(self.cfg.draft.num_speculative_tokens, room - 1))

    def _reserve(self, r: Request, k: int) -> bool:
        """Make the block table cover every position this step may write."""
        need = math.ceil((r.num_tokens + k) / self.cfg.block_size) - len(r.block_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            self.running.pop(r.request_id)
            self._finish(r, FinishReason.ERROR, "the decode KV pool is exhausted")
            return False
        r.block_table.extend(self.allocator.allocate(need))
        return True

    def _apply(self, r: Request, em: Emission) -> None:
        sp = r.sampling
        if em.num_drafted:
            r.stats.num_steps += 1
            r.stats.num_draft_tokens += em.num_drafted
            r.stats.num_accepted_tokens += em.num_accepted
            rate = em.num_accepted / em.num_drafted
            prev = r.acceptance_estimate
            r.acceptance_estimate = rate if prev is None else (1 - EMA) * prev + EMA * rate
        new: list[int] = []
        reason: FinishReason | None = None
        for tok in em.tokens:
            r.output_token_ids.append(tok)
            new.append(tok)
            if tok in sp.stop_token_ids:
                reason = FinishReason.STOP
            elif len(r.output_token_ids) >= sp.max_tokens or r.num_tokens >= self.cfg.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                break
        if reason is not None:
            self.running.pop(r.request_id)
            self._finish(r, reason, None, tuple(new))
        else:
            self._outbox.append(StepOutput(r.request_id, tuple(new), None, self._usage(r)))

    # ---- admission and KV pulls ----------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting:
            req, handoff = self.waiting[0]
            tokens = handoff.num_tokens if handoff else req.num_tokens
            need = math.ceil((tokens + 1) / self.cfg.block_size)
            if not self.allocator.can_allocate(need):
                return  # first come, first served: wait for blocks to free up
            self.waiting.popleft()
            req.block_table = self.allocator.allocate(need)
            if handoff is None:
                req.num_computed = req.num_draft_computed = 0
                req.status = RequestStatus.RUNNING
                self.running[req.request_id] = req
            else:
                self._start_pull(req, handoff)

    def _start_pull(self, req: Request, handoff: KVHandoff) -> None:
        if handoff.lease_expiry - time.time() < self.cfg.pull_margin_s:
            self.transport.counters.fail("lease_expired")
            self._finish(
                req, FinishReason.ERROR, "the prefill lease expired before decode could pull"
            )
            return
        local = req.block_table[: len(handoff.block_ids)]
        try:
            pull = self.transport.start_pull(handoff, local)
        except KVTransferError as e:
            self._finish(req, FinishReason.ERROR, f"KV transfer failed: {e}")
            return
        req.status = RequestStatus.WAITING_FOR_KV
        self.pulling[req.request_id] = (req, handoff, pull)

    def _poll_pulls(self) -> None:
        for rid, (req, handoff, pull) in list(self.pulling.items()):
            state = self.transport.poll(pull)
            if state is PullState.PENDING:
                continue
            del self.pulling[rid]
            self.transport.finish(pull)
            if state is PullState.FAILED:
                self._finish(req, FinishReason.ERROR, "KV transfer failed")
            elif time.time() > handoff.lease_expiry:
                self.transport.counters.fail("lease_expired")
                self._finish(req, FinishReason.ERROR, "the prefill lease expired during the pull")
            else:
                req.num_computed = handoff.num_tokens
                req.num_draft_computed = handoff.num_tokens if "draft" in handoff.groups else 0
                req.output_token_ids = [handoff.first_token]
                req.acceptance_estimate = handoff.acceptance_probe
                req.status = RequestStatus.RUNNING
                self.running[rid] = req

    # ---- completion ----------------------------------------------------------------------

    def _usage(self, r: Request) -> SpecUsage:
        s = r.stats
        return SpecUsage(s.num_steps, s.num_draft_tokens, s.num_accepted_tokens)

    def _release(self, r: Request) -> None:
        if r.block_table:
            self.allocator.free(r.block_table)
            r.block_table = []
        r.status = RequestStatus.FINISHED

    def _finish(
        self, r: Request, reason: FinishReason, error: str | None, new: tuple[int, ...] = ()
    ) -> None:
        if error:
            log.warning("request %s failed: %s", r.request_id, error)
        r.finish_reason, r.error = reason, error
        self._release(r)
        self._outbox.append(StepOutput(r.request_id, new, reason.value, self._usage(r), error))

    def _fail(self, r: Request, error: str) -> None:
        self._finish(r, FinishReason.ERROR, error)

    def close(self) -> None:
        self.transport.close()
