"""The decode pool in the simulator: D continuous-batching replicas, stepped with numpy.

Each replica runs the engine's loop. When a step ends, every request in it emits tokens — the
accepted drafts, drawn from the truncated geometric law of its class's acceptance rate, plus one
recovered or bonus token; finished requests leave and free their KV; queued requests whose KV
has arrived join (up to ``max_batch`` sequences; KV for prompt plus output is reserved on
joining, so nothing is preempted); then the next step's speculation lengths come from
``speculation.goodput.choose_ks`` over the batch's acceptance rates (charging the draft rounds, as
the engine does), and the step takes
``StepTimeModel.predict(sum(1 + k_i))`` seconds plus ``max k_i`` draft rounds of
``draft_round_s`` each (a draft model proposes in sequential rounds). A replica with nothing to
do sleeps until its first queued request's KV arrives.

``choose_ks`` is memoised by batch composition (requests per class). For the key, counts above
16 are rounded onto a 6% geometric grid; each class gets the mean k that ``choose_ks`` gave its
members, rounded stochastically per request and step. With ``engine_tpot_slo_s``, ``choose_ks``
keeps its drafts within that TPOT SLO (``decode.speculation_tpot_slo_s``) up to
``engine_slo_max_loss`` of a step's goodput (``decode.speculation_tpot_slo_max_loss``); the
per-class rounding keeps it on average over steps, not in every step.
"""

from __future__ import annotations

import itertools
import math
from collections import deque

import numpy as np
import numpy.typing as npt

from bench.routersim.profiles import Profile
from cluster.routing.score import StepTable
from cluster.routing.table import ReplicaTable
from speculation.goodput import (
    GUARD_MAX_LOSS,
    DraftBatch,
    StepCosts,
    TpotGuard,
    choose_ks,
    expected_tokens,
)

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
GRID = math.log(1.06)


class DecodePool:
    def __init__(
        self,
        p: Profile,
        replicas: int,
        alphas: FloatArray,  # per class
        cls: IntArray,  # per request
        reserve: IntArray,  # KV tokens per request (prompt + output)
        first_left: IntArray,  # tokens each request still has to emit on decode
        ready: FloatArray,  # when each request's KV is on its decode replica
        seed: int,
        engine_tpot_slo_s: float | None = None,  # the TPOT SLO adaptive speculation keeps to
        engine_slo_max_loss: float = GUARD_MAX_LOSS,  # the most goodput that gives up
    ) -> None:
        d, b = replicas, p.max_batch
        self.p, self.d, self.b = p, d, b
        self.rng = np.random.default_rng(seed)
        self.req = np.full((d, b), -1, dtype=np.int64)
        self.cls = np.zeros((d, b), dtype=np.int64)
        self.left = np.zeros((d, b), dtype=np.int64)
        self.k = np.zeros((d, b), dtype=np.int64)
        self.n_active = np.zeros(d, dtype=np.int64)
        self.hi = np.zeros(d, dtype=np.int64)  # slots used lie below this (lowest free first)
        self.counts = np.zeros((d, alphas.size), dtype=np.int64)
        self.kv_used = np.zeros(d, dtype=np.int64)
        self.step_end = np.full(d, np.inf)
        self.step_s = np.zeros(d)  # how long each replica's current step takes (0: idle)
        self.tokens = np.zeros(d, dtype=np.int64)
        self.queues: list[deque[int]] = [deque() for _ in range(d)]
        self.qlen = np.zeros(d, dtype=np.int64)
        self.alphas = alphas
        self.log_alpha = np.log(np.clip(alphas, 1e-9, 1 - 1e-9))
        self.inv_e = np.array(
            [[1.0 / expected_tokens(a, k) for k in range(p.k_max + 1)] for a in alphas]
        )
        self.steps = StepTable.of(p.step_time, p.max_batched_tokens + p.max_batch * (p.k_max + 1))
        self.memo: dict[int, FloatArray] = {}  # composition key -> mean k per class
        self.engine_tpot_slo_s = engine_tpot_slo_s
        self.engine_slo_max_loss = engine_slo_max_loss
        self.req_cls, self.reserve, self.first_left, self.ready = cls, reserve, first_left, ready
        self.finish = np.full(cls.size, np.nan)
        self.emitted = 0
        self.step_count = 0

    # ---- requests in ---------------------------------------------------------------------

    def ongoing(self, row: int) -> int:
        """Requests the replica holds (what Ray Serve's queue-length probe reports)."""
        return int(self.n_active[row] + self.qlen[row])

    def enqueue(self, row: int, i: int) -> None:
        self.queues[row].append(i)
        self.qlen[row] += 1
        if self.n_active[row] == 0:  # asleep: wake when the first queued KV has arrived
            self.step_end[row] = min(self.step_end[row], self.ready[self.queues[row][0]])

    # ---- time ----------------------------------------------------------------------------

    def next_event(self) -> float:
        return float(self.step_end.min())

    def advance(self, until: float) -> None:
        """Run every step that ends before ``until``."""
        while True:
            rows = np.flatnonzero(self.step_end < until)
            if rows.size == 0:
                return
            self._step_ends(rows)

    def _step_ends(self, rows: IntArray) -> None:
        te = self.step_end[rows]
        self._emit(rows, te)
        for j in np.flatnonzero(self.qlen[rows] > 0).tolist():
            self._admit(int(rows[j]), float(te[j]))
        self._plan(rows, te)

    def _emit(self, rows: IntArray, te: FloatArray) -> None:
        w = int(self.hi[rows].max())
        req = self.req[rows, :w]
        act = req >= 0
        if not act.any():
            return
        c = self.cls[rows, :w]
        u = self.rng.random(req.shape)
        accepted = np.minimum(np.floor(np.log(u) / self.log_alpha[c]), self.k[rows, :w])
        left = self.left[rows, :w]
        emitted = np.minimum(accepted.astype(np.int64) + 1, left) * act
        left -= emitted
        self.left[rows, :w] = left
        self.emitted += int(emitted.sum())
        done = act & (left <= 0)
        if done.any():
            ri, ci = np.nonzero(done)
            rr = rows[ri]
            ids = req[ri, ci]
            self.finish[ids] = te[ri]
            self.req[rr, ci] = -1
            np.subtract.at(self.counts, (rr, c[ri, ci]), 1)
            np.subtract.at(self.n_active, rr, 1)
            np.subtract.at(self.kv_used, rr, self.reserve[ids])

    def _admit(self, row: int, te: float) -> None:
        q, req_row = self.queues[row], self.req[row]
        free: list[int] | None = None
        while q and self.n_active[row] < self.b:
            i = q[0]
            if self.ready[i] > te or self.kv_used[row] + self.reserve[i] > self.p.kv_tokens:
                break
            q.popleft()
            if free is None:
                free = np.flatnonzero(req_row < 0).tolist()[::-1]
            col = free.pop()
            self.hi[row] = max(self.hi[row], col + 1)
            c = int(self.req_cls[i])
            req_row[col] = i
            self.cls[row, col] = c
            self.left[row, col] = self.first_left[i]
            self.counts[row, c] += 1
            self.n_active[row] += 1
            self.kv_used[row] += self.reserve[i]
            self.qlen[row] -= 1

    def _plan(self, rows: IntArray, te: FloatArray) -> None:
        busy = self.n_active[rows] > 0
        idle_rows = rows[~busy]
        for row in idle_rows.tolist():
            q = self.queues[row]
            self.step_end[row] = self.ready[q[0]] if q else np.inf
        self.tokens[idle_rows] = 0
        self.step_s[idle_rows] = 0.0
        self.hi[idle_rows] = 0
        rows, te = rows[busy], te[busy]
        if rows.size == 0:
            return
        lo, frac = self._ks_by_class(self.counts[rows])
        w = int(self.hi[rows].max())
        req = self.req[rows, :w]
        act = req >= 0
        c = self.cls[rows, :w]
        ri = np.arange(rows.size)[:, None]
        k = lo[ri, c] + (self.rng.random(req.shape) < frac[ri, c])
        k = np.clip(np.minimum(k, self.left[rows, :w] - 1), 0, None) * act
        self.k[rows, :w] = k
        tokens = (act + k).sum(axis=1)
        self.tokens[rows] = tokens
        rounds = self.p.draft_round_s * k.max(axis=1)
        self.step_s[rows] = self.steps.at(tokens) + rounds
        self.step_end[rows] = te + self.step_s[rows]
        self.step_count += rows.size

    def _ks_by_class(self, counts: IntArray) -> tuple[IntArray, FloatArray]:
        """Per row and class: the floor of the mean k ``choose_ks`` gives, and the fraction
        of members that get one more."""
        grid = np.round(16 * np.exp(np.round(np.log(np.maximum(counts, 1) / 16) / GRID) * GRID))
        q = np.where(counts > 16, grid, counts).astype(np.int64)
        keys = (q * (4096 ** np.arange(q.shape[1]))).sum(axis=1).tolist()
        means = np.empty(counts.shape)
        for j, key in enumerate(keys):
            got = self.memo.get(key)
            if got is None:
                got = self.memo[key] = self._mean_ks(q[j])
            means[j] = got
        lo = np.floor(means)
        return lo.astype(np.int64), means - lo

    def _mean_ks(self, q: IntArray) -> FloatArray:
        alphas = [float(a) for a, n in zip(self.alphas, q.tolist(), strict=True) for _ in range(n)]
        ks = np.asarray(
            choose_ks(
                DraftBatch(alphas, self.p.k_max),
                StepCosts(
                    self.p.step_time, self.p.max_batched_tokens, round_s=self.p.draft_round_s
                ),
                TpotGuard(self.engine_tpot_slo_s, self.engine_slo_max_loss),
            )
        )
        starts = np.concatenate([[0], np.cumsum(q)])
        return np.array([ks[a:b].mean() if b > a else 0.0 for a, b in itertools.pairwise(starts)])

    # ---- what the router is told ---------------------------------------------------------

    def publish(self, table: ReplicaTable, now: float) -> None:
        """Every replica's routing stats, as ``DecodeEngine.routing_stats`` would report them."""
        act = self.req >= 0
        inv_e = self.inv_e[self.cls, self.k]
        weight = (inv_e * act).sum(axis=1)
        slowest = (inv_e * act).max(axis=1)
        emitted = (act / inv_e).sum(axis=1)
        max_k = (self.k * act).max(axis=1)
        tokens = np.where(self.n_active > 0, self.tokens, 0)
        free_blocks = (self.p.kv_tokens - self.kv_used) // 16
        table.set_many(
            np.arange(self.d),
            self.n_active.astype(np.float64),
            self.qlen.astype(np.float64),
            tokens.astype(np.float64),
            weight,
            slowest,
            emitted,
            max_k.astype(np.float64),
            free_blocks.astype(np.float64),
            now,
        )
