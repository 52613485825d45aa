"""The prefill worker: runs the target (and draft) over a prompt into leased KV blocks.

One worker owns one KV pool registered once with its transport. For each request it computes
the prompt's KV for every KV group, samples the first token with the request's own sampling
parameters, estimates the draft's acceptance rate from both models' distributions over the
prompt (the probe), and returns a :class:`KVHandoff`. The blocks stay leased until decode has
read them (the transport's completion notice) or the lease expires.

Not thread-safe: the Serve deployment runs every call on one worker thread. After start-up
only the worker's own progress thread touches the transport: it drives the transport's
progress (so decode's reads are served) and collects completion notices for ``reap``.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kvtransfer.allocator import BlockAllocator, OutOfBlocksError
from kvtransfer.handoff import KVCompat, KVHandoff
from kvtransfer.leases import Lease, LeaseTable
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import KV_LAYOUT, KVPool, KVPoolSpec, group_spec
from kvtransfer.transport import KVTransport
from models.acceptance import one_hot_overlap, overlap, probe_estimate
from models.ngram import ngram_lookup
from models.request import FinishReason, Request
from models.runner import SeqInput, run_step
from models.sampling import Stream, probs_from_logits, sample_token
from models.spec import DraftKind
from prefill.config import PrefillWorkerConfig

log = logging.getLogger(__name__)
ACTIVE_POLL_S = 0.0002  # progress period while some lease may be read
IDLE_POLL_S = 0.005


class PrefillCapacityError(RuntimeError):
    """The prompt needs more KV blocks than this worker can free right now."""


@dataclass(frozen=True)
class PrefillStats:
    num_blocks: int
    free_blocks: int
    leased_blocks: int
    active_leases: int
    prefills: int
    prompt_tokens: int


class PrefillWorker:
    def __init__(self, cfg: PrefillWorkerConfig) -> None:
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        self.cfg = cfg
        self.target = cfg.target.load(cfg.device)
        self.draft_model = cfg.draft.model.load(cfg.device) if cfg.draft.model else None
        tc = self.target.cfg
        groups = [
            group_spec("target", tc.num_layers, tc.num_kv_heads, tc.head_dim, cfg.target.dtype)
        ]
        if self.draft_model is not None and cfg.draft.model is not None:
            dc = self.draft_model.cfg
            groups.append(
                group_spec(
                    "draft", dc.num_layers, dc.num_kv_heads, dc.head_dim, cfg.draft.model.dtype
                )
            )
        self.pool = KVPool(KVPoolSpec(cfg.num_blocks, cfg.block_size, tuple(groups)), cfg.device)
        self.allocator = BlockAllocator(cfg.num_blocks)
        self.leases = LeaseTable()
        self.transport: KVTransport = NixlTransport(self.pool, role="prefill")
        self.compat = KVCompat(
            model=cfg.target.fingerprint(),
            dtype=cfg.target.dtype,
            block_size=cfg.block_size,
            kv_layout=KV_LAYOUT,
            tp_size=1,
            draft=cfg.draft.identity(),
        )
        self._prefills = 0
        self._prompt_tokens = 0
        self._completed: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._progress = threading.Thread(
            target=self._progress_loop, name="tandem-kv-progress", daemon=True
        )
        self._progress.start()

    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            for rid in self.transport.completed():
                self._completed.put(rid)
            time.sleep(ACTIVE_POLL_S if len(self.leases) else IDLE_POLL_S)

    @property
    def max_prompt_tokens(self) -> int:
        return self.cfg.num_blocks * self.cfg.block_size

    def reap(self, now: float | None = None) -> int:
        """End leases whose pull completed or that expired; return the blocks freed."""
        freed = 0
        while not self._completed.empty():
            lease = self.leases.pop(self._completed.get_nowait())
            if lease is not None:
                self.allocator.free(lease.blocks)
                freed += len(lease.blocks)
        for lease in self.leases.pop_expired(time.time() if now is None else now):
            log.warning("lease of %s expired before decode pulled it", lease.request_id)
            self.allocator.free(lease.blocks)
            freed += len(lease.blocks)
        return freed

    def prefill(self, req: Request) -> KVHandoff:
        """Compute the prompt's KV, sample the first token, and lease the blocks to decode."""
        self.reap()
        n = len(req.prompt_token_ids)
        need = math.ceil(n / self.cfg.block_size)
        if need > self.cfg.num_blocks:
            raise PrefillCapacityError(
                f"prompt of {n} tokens exceeds the prefill KV pool "
                f"({self.max_prompt_tokens} tokens)"
            )
        try:
            blocks = self.allocator.allocate(need)
        except OutOfBlocksError as e:
            raise PrefillCapacityError(str(e)) from e
        try:
            first, probe = self._compute(req, blocks)
        except BaseException:
            self.allocator.free(blocks)
            raise
        self._prefills += 1
        self._prompt_tokens += n
        finish = self._finish_reason(req, first)
        if finish is not None:  # nothing left for decode to do: don't hold the blocks
            self.allocator.free(blocks)
            blocks = []
        else:
            expiry = time.time() + self.cfg.lease_seconds
            self.leases.add(Lease(req.request_id, tuple(blocks), expiry))
        return KVHandoff(
            request_id=req.request_id,
            source=self.transport.source(),
            block_ids=tuple(blocks),
            groups=tuple(self.pool.tensors),
            num_tokens=n,
            first_token=first,
            compat=self.compat,
            lease_expiry=time.time() + self.cfg.lease_seconds,
            acceptance_probe=probe,
            finish_reason=finish.value if finish else None,
        )

    def _compute(self, req: Request, blocks: list[int]) -> tuple[int, float | None]:
        prompt = req.prompt_token_ids
        n = len(prompt)
        w = max(1, min(self.cfg.probe_window, n))
        positions = list(range(n - w, n))
        seq = SeqInput(blocks, 0, prompt, positions)
        bs = self.cfg.block_size
        target = run_step(self.target, self.pool.tensor("target"), bs, [seq])
        p = probs_from_logits(target.logits, [req.sampling] * w)  # [W, V]
        first = sample_token(p[-1], req.sampling, 0, Stream.SAMPLE)
        probe: float | None = None
        kind = self.cfg.draft.kind
        if self.draft_model is not None:
            draft = run_step(self.draft_model, self.pool.tensor("draft"), bs, [seq])
            q = probs_from_logits(draft.logits, [req.sampling] * w)
            probe = probe_estimate(overlap(p, q))
        elif kind is DraftKind.NGRAM:
            d = self.cfg.draft
            proposals = [
                (ngram_lookup(prompt[: t + 1], 1, d.ngram_max, d.ngram_min) or [-1])[0]
                for t in positions
            ]
            probe = probe_estimate(one_hot_overlap(p, torch.tensor(proposals, device=p.device)))
        return first, probe

    @staticmethod
    def _finish_reason(req: Request, first: int) -> FinishReason | None:
        sp = req.sampling
        if first in sp.stop_token_ids:
            return FinishReason.STOP
        if sp.max_tokens <= 1:
            return FinishReason.LENGTH
        return None

    def stats(self) -> PrefillStats:
        return PrefillStats(
            num_blocks=self.cfg.num_blocks,
            free_blocks=self.allocator.num_free,
            leased_blocks=self.leases.num_blocks,
            active_leases=len(self.leases),
            prefills=self._prefills,
            prompt_tokens=self._prompt_tokens,
        )

    def close(self) -> None:
        self._stop.set()
        self._progress.join(timeout=1.0)
        self.transport.close()
