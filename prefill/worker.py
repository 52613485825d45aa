"""The prefill worker: prompts in, leased KV blocks and ``KVHandoff``s out. ``submit`` and
``cancel`` may be called from any thread, the rest only from the one thread calling ``step``;
after start-up only the progress thread touches the transport."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import replace

import torch

from kvtransfer.allocator import BlockAllocator, block_hashes
from kvtransfer.handoff import KVHandoff, kv_compat
from kvtransfer.leases import Lease, LeaseTable
from models.host_memory import release_free_heap
from models.logits_processing import ProcessRow, process_logits
from models.logprobs import token_logprobs
from models.request import FinishReason, Request
from models.sampling import Stream, probs_from_logits, sample_token
from models.spec import DraftKind
from prefill.chunks import plan_chunks, window_rows
from prefill.config import PrefillWorkerConfig
from prefill.drafting import run_draft
from prefill.probe import acceptance_probe
from prefill.prompt_state import Done, PromptState
from prefill.stats import PrefillStats
from runtime.build import build_shard
from runtime.runner import SeqInput
from runtime.shard import ShardSpec
from serving.grammars import ReplicaGrammars

log = logging.getLogger(__name__)
ACTIVE_POLL_S = 0.0002
IDLE_POLL_S = 0.005


class PrefillCapacityError(RuntimeError):
    """The prompt needs more KV blocks than this worker's pool holds."""


class PrefillWorker:
    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        self.cfg = cfg
        self.shard = build_shard(
            ShardSpec(
                role="prefill",
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
                memory_utilization=cfg.gpu_memory_utilization,
                profile_tokens=cfg.max_num_batched_tokens,
                profile_seqs=1,
            )
        )
        # sized from memory: what the pool holds, from here on
        self.cfg = cfg = replace(cfg, num_blocks=self.shard.pool.spec.num_blocks)
        self.pool = self.shard.pool
        self.target = self.shard.target
        self.draft = self.shard.draft
        self.transport = self.shard.transport
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.leases = LeaseTable()
        self._cooling: deque[tuple[float, tuple[int, ...]]] = deque()  # (monotonic end, blocks)
        self.compat = kv_compat(
            cfg.target, cfg.block_size, cfg.tp_size, cfg.draft.identity(), self.transport.wire
        )
        self.grammars = ReplicaGrammars(cfg.target)
        self._queue: list[PromptState] = []
        self._inbox: queue.SimpleQueue[PromptState | str] = queue.SimpleQueue()
        self._completed: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stats = PrefillStats(num_blocks=cfg.num_blocks)
        self._ran_since_release = False
        self._stop = threading.Event()
        self._progress = threading.Thread(
            target=_progress_loop,
            args=(weakref.ref(self), self._stop),
            name="tandem-kv-progress",
            daemon=True,
        )
        self._progress.start()
        # a daemon thread inside a NIXL call at exit aborts the process: stop it without close()
        self._finalizer = weakref.finalize(self, _stop_thread, self._stop, self._progress)

    def submit(self, req: Request, on_done: Done) -> None:
        """Queue a prompt; ``on_done`` later receives its handoff or the error."""
        caching = self.cfg.enable_prefix_caching
        bs, salt = self.cfg.block_size, req.cache_salt.encode()
        hashes = block_hashes(req.prompt_token_ids, bs, salt) if caching else []
        try:  # a no-op when the server prepared it off this thread, as it does
            self.grammars.attach(req)
        except ValueError as e:
            on_done(e)
            return
        self._inbox.put(PromptState(req, on_done, hashes))

    def cancel(self, request_id: str) -> None:
        """The client is gone: drop the prompt, or end its lease if it was already handed off."""
        self._inbox.put(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self._queue) or not self._inbox.empty()

    def prefill(self, req: Request) -> KVHandoff:
        out: list[KVHandoff | BaseException] = []
        self.submit(req, out.append)
        while not out:
            self.step()
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def step(self) -> None:
        self._drain_inbox()
        self.reap()
        self._admit()
        active = [p for p in self._queue if p.admitted]
        chunks = plan_chunks(
            [(p.num_computed, p.length) for p in active], self.cfg.max_num_batched_tokens
        )
        if not chunks:
            return
        self._ran_since_release = True
        batch = []
        for c in chunks:
            p = active[c.index]
            rows = window_rows(c, p.length, self.cfg.probe_window)
            batch.append(SeqInput(p.blocks, c.start, p.req.prompt_token_ids[c.start : c.end], rows))
        prompts = [active[c.index].req.prompt_token_ids for c in chunks]
        try:
            target = self.target.run(batch)
            draft = run_draft(self.draft, batch, target, prompts) if self.draft else None
        except Exception as e:
            log.exception("prefill forward failed")
            for c in chunks:
                self._fail(active[c.index], e)
            return
        row, offset = 0, 0
        for i, (c, seq) in enumerate(zip(chunks, batch, strict=True)):
            p = active[c.index]
            n = len(seq.logit_positions)
            if n:
                p.target_logits.append(target.logits[row : row + n])
                p.positions.extend(c.start + r for r in seq.logit_positions)
            if draft is not None:
                p.draft_logits.update(draft.rows[i])
                p.draft_computed = draft.computed[i]
            if c.end == p.length:
                p.last_feature = target.all_hidden[offset + c.end - c.start - 1].detach().cpu()
            row += n
            offset += c.end - c.start
            p.num_computed = c.end
            self._stats.prompt_tokens_computed += c.end - c.start
            if p.num_computed == p.length:
                self._finish(p)

    def _drain_inbox(self) -> None:
        while not self._inbox.empty():
            item = self._inbox.get_nowait()
            if isinstance(item, PromptState):
                self._queue.append(item)
                continue
            for p in self._queue:
                if p.req.request_id == item:
                    self._queue.remove(p)
                    if p.blocks:
                        self.allocator.free(p.blocks)
                    break
            else:
                lease = self.leases.pop(item)
                if lease is not None:
                    self.allocator.free(lease.blocks)

    def _admit(self) -> None:
        bs = self.cfg.block_size
        for p in list(self._queue):
            if p.admitted:
                continue
            need_total = math.ceil(p.length / bs)
            if need_total > self.cfg.num_blocks:
                self._fail(
                    p,
                    PrefillCapacityError(
                        f"prompt of {p.length} tokens exceeds the prefill KV pool "
                        f"({self.cfg.num_blocks * bs} tokens)"
                    ),
                )
                continue
            # Keep at least the last prompt token to compute: its logits give the first token.
            keys = p.hashes[: (p.length - 1) // bs]
            cached = self.allocator.lookup(keys, self._contents(p, len(keys)))
            if not self.allocator.can_allocate(need_total - len(cached)):
                self.allocator.free(cached)
                return  # first come, first served: wait for leases to end
            p.blocks = cached + self.allocator.allocate(need_total - len(cached))
            p.num_computed = len(cached) * bs
            p.admitted = True
            self._stats.prompt_tokens_cached += p.num_computed

    def _finish(self, p: PromptState) -> None:
        """Hand the prompt's KV over; whatever fails on the way fails this prompt alone, and
        its caller always hears (an unsettled future would hang the client)."""
        try:
            self._hand_over(p)
        except Exception as e:
            log.exception("handing over the prompt of %s failed", p.req.request_id)
            lease = self.leases.pop(p.req.request_id)
            if lease is not None and lease.blocks != tuple(p.blocks):
                self.leases.add(lease)  # another prompt's under the same id: not this one's
            self._fail(p, e)

    def _hand_over(self, p: PromptState) -> None:
        self._queue.remove(p)
        req, sp = p.req, p.req.sampling
        try:
            logits = torch.cat(p.target_logits)  # [W, V]
            probs = probs_from_logits(logits, [sp] * len(p.positions))
            first = sample_token(_first_probs(req, logits[-1:], probs[-1]), sp, 0, Stream.SAMPLE)
            first_logprob = (
                None
                if sp.logprobs is None
                else token_logprobs(logits[-1:], [first], [sp.logprobs])[0]
            )
            probe = acceptance_probe(
                self.cfg.draft, req.prompt_token_ids, sp, p.positions, probs, p.draft_logits
            )
        except Exception as e:
            self._fail(p, e)
            return
        for block, h, tokens in zip(
            p.blocks, p.hashes, self._contents(p, len(p.hashes)), strict=False
        ):
            self.allocator.register(block, h, tokens)
        self._stats.prefills += 1
        finish = FinishReason.STOP if first in sp.stop_token_ids else None
        if req.grammar is not None:
            req.grammar.sync([first])
            finish = FinishReason.STOP if req.grammar.stopped else finish
        if finish is None and sp.max_tokens <= 1:
            finish = FinishReason.LENGTH
        issued = time.time()
        expiry = time.monotonic() + self.cfg.lease_seconds
        blocks = tuple(p.blocks)
        payload = None
        if finish is not None and sp.n == 1:  # nothing left for decode: don't hold the blocks
            self.allocator.free(p.blocks)
            p.blocks, blocks = [], ()
        else:
            self.leases.add(Lease(req.request_id, blocks, expiry))
            payload = self.transport.export(req.request_id, blocks, tuple(self.pool.tensors))
        p.on_done(
            KVHandoff(
                request_id=req.request_id,
                sources=self.transport.sources(),
                block_ids=blocks,
                groups=tuple(self.pool.tensors),
                num_tokens=p.length,
                first_token=first,
                compat=self.compat,
                lease_seconds=self.cfg.lease_seconds,
                acceptance_probe=probe,
                draft_computed=p.draft_computed,
                hidden_state=p.last_feature if self.cfg.draft.kind is DraftKind.EAGLE else None,
                finish_reason=finish.value if finish else None,
                first_logprob=first_logprob,
                payload=payload,
                lease_stamped_at=issued,
            )
        )

    def _contents(self, p: PromptState, n: int) -> list[list[int]]:
        """What each of the first ``n`` full blocks' KV depends on: its tokens, and for an EAGLE
        head the next token too (slot t reads token t + 1); a block without one is not cached."""
        bs = self.cfg.block_size
        extra = 1 if self.cfg.draft.kind is DraftKind.EAGLE else 0
        ids = p.req.prompt_token_ids
        out = [ids[j * bs : (j + 1) * bs + extra] for j in range(n)]
        return [c for c in out if len(c) == bs + extra]

    def _fail(self, p: PromptState, error: BaseException) -> None:
        if p in self._queue:
            self._queue.remove(p)
        if p.blocks:
            self.allocator.free(p.blocks)
            p.blocks = []
        try:
            p.on_done(error)
        except Exception:  # the caller's loop is gone: nobody is left to tell
            log.exception("reporting the failure of %s failed", p.req.request_id)

    def _poll_transport(self) -> float:
        try:
            for rid in self.transport.completed():
                self._completed.put(rid)
        except Exception:  # keep serving reads; leases still end by expiry meanwhile
            log.exception("KV transport progress failed")
            return 0.1
        return ACTIVE_POLL_S if len(self.leases) else IDLE_POLL_S

    def reap(self, now: float | None = None) -> int:
        """End leases pulled or expired by ``now`` (monotonic); return the blocks freed."""
        freed = 0
        while not self._completed.empty():
            lease = self.leases.pop(self._completed.get_nowait())
            if lease is not None:
                self.allocator.free(lease.blocks)
                freed += len(lease.blocks)
        now = time.monotonic() if now is None else now
        for lease in self.leases.pop_expired(now):
            log.warning("lease of %s expired before decode pulled it", lease.request_id)
            self._stats.leases_expired += 1
            # a read decode started just in time may still land: its blocks wait out the grace
            self._cooling.append((lease.expires_at + self.cfg.lease_grace_s, lease.blocks))
        while self._cooling and self._cooling[0][0] <= now:
            blocks = self._cooling.popleft()[1]
            self.allocator.free(blocks)
            freed += len(blocks)
        return freed

    def release_memory(self) -> int | None:
        """Give heap memory freed since the last call back to the system if a forward ran since
        (per-token-count temporaries pile up otherwise). Returns bytes given back, or None."""
        if not self._ran_since_release:
            return None
        self._ran_since_release = False
        released = release_free_heap()
        if released is not None:
            self._stats.heap_releases += 1
            self._stats.heap_released_bytes += released
            log.debug("idle prefill gave %.1f MiB of free heap back", released / 2**20)
        return released

    def stats(self) -> PrefillStats:
        s = self._stats
        s.free_blocks = self.allocator.num_free
        s.cached_blocks = self.allocator.num_cached
        s.leased_blocks = self.leases.num_blocks
        s.cooling_blocks = sum(len(blocks) for _, blocks in self._cooling)
        s.active_leases = len(self.leases)
        s.queued = len(self._queue)
        return PrefillStats(**s.__dict__)

    def close(self) -> None:
        self._finalizer()
        self.grammars.close()
        self.shard.close()


def _first_probs(req: Request, last: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """[V] the first token's distribution: ``probs`` unless its logits (last: [1, V]) are
    processed, as decode processes every later position."""
    sp = req.sampling
    if not sp.processes:
        return probs
    allowed = req.grammar.masks((), ())[0] if req.grammar is not None else None
    row = ProcessRow(sp, req.prompt_token_ids, (), allowed)
    return probs_from_logits(process_logits(last, [row]), [sp])[0]


def _progress_loop(ref: weakref.ref[PrefillWorker], stop: threading.Event) -> None:
    """Poll the worker's transport until stopped; the worker is held for one poll only, never
    across the sleep, so a worker dropped without ``close()`` is collected and stops this thread."""
    while not stop.is_set():
        worker = ref()
        if worker is None:
            return
        delay = worker._poll_transport()
        del worker
        time.sleep(delay)


def _stop_thread(stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    if thread is not threading.current_thread():  # the finalizer may run on the thread itself
        thread.join(timeout=1.0)
