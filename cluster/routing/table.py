"""The router's view of the decode replicas: one row per replica, numpy columns. A row is the
replica's last ``RoutingStats`` plus an overlay of what this router sent it since (else every
decision between two refreshes would pile onto one replica); policies read the ``eff_*`` sums."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from cluster.routing.columns import EFFECTIVE, OVERLAY, STATS, Columns
from cluster.routing.score import StepTable
from speculation.routing_stats import RoutingStats
from speculation.step_time import StepTimeModel

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


class Sent(NamedTuple):
    time: float  # router clock
    k: int
    expected: float
    blocks: int
    joins: bool  # joins the batch (else the queue)
    width: int  # tokens per draft level (its tree's width, else 1)


class SentLog:
    """Per row, the requests sent since its snapshot, oldest first."""

    def __init__(self) -> None:
        self._rows: list[deque[Sent]] = []

    def grow(self, n: int) -> None:
        self._rows.extend(deque() for _ in range(n))

    def add(self, row: int, sent: Sent) -> None:
        self._rows[row].append(sent)

    def clear(self, row: int) -> None:
        self._rows[row].clear()

    def __contains__(self, row: int) -> bool:
        """Whether anything sent to ``row`` is not yet in its snapshot."""
        return bool(self._rows[row])

    def drop_until(self, row: int, snapshot_time: float) -> Iterator[Sent]:
        """Remove and yield the requests a snapshot taken at ``snapshot_time`` counts."""
        log = self._rows[row]
        while log and log[0].time <= snapshot_time:
            yield log.popleft()

    def joined_peaks(self, row: int) -> tuple[int, float]:
        """The largest k and ``1 / expected`` among the logged requests that joined the batch."""
        joined = [s for s in self._rows[row] if s.joins]
        k = max((s.k for s in joined), default=0)
        return k, max((1 / s.expected for s in joined), default=0.0)


class StepModels:
    """The rows' step-time models, one per distinct model, each tabulated once; replicas refine
    theirs while serving, so a model no row uses is dropped."""

    def __init__(self) -> None:
        self.models: dict[int, StepTimeModel] = {}
        self.steps: dict[int, StepTable] = {}
        self._ids: dict[tuple[tuple[int, float], ...], int] = {}
        self._refs: dict[int, int] = {}  # rows using each model
        self._next = 0

    def index(self, model: StepTimeModel | None) -> int:
        """The id of ``model`` (-1 for none); equal models share one."""
        if model is None:
            return -1
        i = self._ids.get(model.points)
        if i is None:
            i = self._ids[model.points] = self._next
            self._next += 1
            self.models[i], self.steps[i] = model, StepTable.of(model)
            self._refs[i] = 0
        return i

    def acquire(self, mid: int, rows: int) -> None:
        if mid >= 0:
            self._refs[mid] += rows

    def release(self, mid: int, rows: int) -> None:
        if mid < 0:
            return
        self._refs[mid] -= rows
        if self._refs[mid] == 0:
            del self._ids[self.models.pop(mid).points]
            del self.steps[mid], self._refs[mid]


class ReplicaTable(Columns):
    def __init__(self, rows: int = 0) -> None:
        self.size = 0
        self._usable: BoolArray | None = None  # alive, with stats and a model (cached)
        self._oldest = -np.inf  # earliest received_at among usable rows (cached)
        self._usable_is_alive: bool | None = None
        self._adaptive: BoolArray | None = None
        self._k_cap = 0
        self.step_models = StepModels()
        self._sent = SentLog()
        self.alive = np.zeros(0, dtype=bool)
        self.has_stats = np.zeros(0, dtype=bool)
        self.model_id = np.zeros(0, dtype=np.int64)
        for name in STATS + OVERLAY + EFFECTIVE:
            setattr(self, name, np.zeros(0, dtype=np.float64))
        self.ensure_rows(rows)

    def ensure_rows(self, n: int) -> None:
        """Grow the columns to hold at least ``n`` rows (new rows are not alive)."""
        if n <= self.size:
            return
        grow = n - self.size
        self.alive = np.concatenate([self.alive, np.zeros(grow, dtype=bool)])
        self.has_stats = np.concatenate([self.has_stats, np.zeros(grow, dtype=bool)])
        self.model_id = np.concatenate([self.model_id, np.full(grow, -1, dtype=np.int64)])
        for name in STATS + OVERLAY + EFFECTIVE:
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(grow)]))
        self._sent.grow(grow)
        self.size = n
        self._usable = None

    @property
    def models(self) -> dict[int, StepTimeModel]:
        return self.step_models.models

    @property
    def steps(self) -> dict[int, StepTable]:
        return self.step_models.steps

    def model_index(self, model: StepTimeModel | None) -> int:
        return self.step_models.index(model)

    def _use_model(self, rows: int | npt.NDArray[np.int64], model: StepTimeModel | None) -> None:
        new = self.step_models.index(model)
        old, counts = np.unique(np.atleast_1d(self.model_id[rows]), return_counts=True)
        self.model_id[rows] = new
        self.step_models.acquire(new, int(np.size(self.model_id[rows])))
        for mid, n in zip(old.tolist(), counts.tolist(), strict=True):
            self.step_models.release(mid, n)

    def set_stats(self, row: int, s: RoutingStats, received_at: float) -> None:
        """A replica's new snapshot (``received_at`` on the router's clock)."""
        self.ensure_rows(row + 1)
        self.alive[row] = self.has_stats[row] = True
        self._use_model(row, s.step_time_model())
        values = (
            s.running, s.queued, s.step_tokens, s.tpot_weight, s.slowest_weight, s.step_emitted,
            float(s.adaptive), s.step_max_k, s.draft_round_s, s.draft_token_s, s.free_blocks,
            s.num_blocks, s.block_size, s.max_batch_size, s.k_max, s.tree_width, s.time,
            received_at,
        )  # fmt: skip
        for name, v in zip(STATS, values, strict=True):
            getattr(self, name)[row] = v
        self._prune(row, s.time)
        self._sync(row)
        self._usable = None

    def set_many(
        self,
        rows: npt.NDArray[np.int64],
        running: FloatArray,
        queued: FloatArray,
        step_tokens: FloatArray,
        tpot_weight: FloatArray,
        slowest_weight: FloatArray,
        step_emitted: FloatArray,
        step_max_k: FloatArray,
        free_blocks: FloatArray,
        now: float,
    ) -> None:
        """Snapshots of many rows taken at ``now`` (the simulator's path; static columns come
        from ``configure``)."""
        self.running[rows], self.queued[rows] = running, queued
        self.step_tokens[rows], self.tpot_weight[rows] = step_tokens, tpot_weight
        self.step_emitted[rows], self.step_max_k[rows] = step_emitted, step_max_k
        self.slowest_weight[rows], self.free_blocks[rows] = slowest_weight, free_blocks
        self.stats_time[rows] = self.received_at[rows] = now
        self.has_stats[rows] = True
        for row in rows.tolist():
            if row in self._sent:
                self._prune(row, now)
        self._sync(rows)
        self._usable = None

    def configure(
        self,
        rows: Sequence[int],
        model: StepTimeModel,
        num_blocks: int,
        block_size: int,
        max_batch: int,
        k_max: int,
        adaptive: bool = True,
        draft_round_s: float = 0.0,
    ) -> None:
        """Mark rows alive with the static part of their stats (no snapshot yet)."""
        idx = np.asarray(rows, dtype=np.int64)
        self.ensure_rows(int(idx.max()) + 1 if idx.size else 0)
        self.alive[idx] = True
        self._use_model(idx, model)
        self.num_blocks[idx], self.block_size[idx] = num_blocks, block_size
        self.max_batch[idx], self.k_max[idx] = max_batch, k_max
        self.adaptive[idx], self.draft_round_s[idx] = float(adaptive), draft_round_s
        self._sync(idx)
        self._usable = None

    def mark_alive(self, row: int) -> None:
        """A replica with no snapshot yet (policies that need stats skip it)."""
        self.ensure_rows(row + 1)
        self.alive[row] = True
        self._usable = None

    def add_routed(
        self,
        row: int,
        k: int,
        expected: float,
        blocks: int,
        joins: bool,
        now: float,
        width: int = 1,
    ) -> None:
        """This router sent the replica a request verifying ``k`` draft levels of ``width``
        tokens, emitting ``expected`` per step, into the batch (else, not ``joins``, the queue)."""
        sent = Sent(now, k, expected, blocks, joins, width)
        self._sent.add(row, sent)
        self._apply(row, sent, 1.0)

    def clear(self, row: int) -> None:
        """The replica is gone; its row may be reused."""
        self.alive[row] = self.has_stats[row] = False
        self._use_model(row, None)
        self._sent.clear(row)
        for name in OVERLAY:
            getattr(self, name)[row] = 0.0
        self._usable = None

    def _apply(self, row: int, e: Sent, sign: float) -> None:
        if e.joins:
            self.o_running[row] += sign
            self.o_tokens[row] += sign * (1 + e.width * e.k)
            self.o_weight[row] += sign / e.expected
            self.o_emitted[row] += sign * e.expected
            if sign > 0:
                self.o_max_k[row] = max(self.o_max_k[row], e.k)
                self.o_slowest[row] = max(self.o_slowest[row], 1 / e.expected)
        else:
            self.o_queued[row] += sign
        self.o_blocks[row] += sign * e.blocks
        self._sync(row)

    def _sync(self, rows: int | npt.NDArray[np.int64]) -> None:
        self.eff_tokens[rows] = self.step_tokens[rows] + self.o_tokens[rows]
        self.eff_weight[rows] = self.tpot_weight[rows] + self.o_weight[rows]
        self.eff_slowest[rows] = np.maximum(self.slowest_weight[rows], self.o_slowest[rows])
        self.eff_emitted[rows] = self.step_emitted[rows] + self.o_emitted[rows]
        self.eff_max_k[rows] = np.maximum(self.step_max_k[rows], self.o_max_k[rows])
        busy = self.running[rows] + self.o_running[rows] + self.queued[rows] + self.o_queued[rows]
        self.eff_slots[rows] = self.max_batch[rows] - busy
        self.eff_free[rows] = self.free_blocks[rows] - self.o_blocks[rows]

    def _prune(self, row: int, snapshot_time: float) -> None:
        for sent in self._sent.drop_until(row, snapshot_time):
            self._apply(row, sent, -1.0)
        if row not in self._sent:  # no float drift left behind
            for name in OVERLAY:
                getattr(self, name)[row] = 0.0
        else:
            self.o_max_k[row], self.o_slowest[row] = self._sent.joined_peaks(row)

    def fresh(self, now: float, max_age_s: float) -> BoolArray:
        """Rows whose snapshot arrived at most ``max_age_s`` ago and carries a step model."""
        if self._usable is None:
            self._refresh_cache()
        assert self._usable is not None
        if now - self._oldest <= max_age_s:
            return self._usable  # the common case: every snapshot is recent
        ok: BoolArray = self._usable & (now - self.received_at <= max_age_s)
        return ok

    def _refresh_cache(self) -> None:
        self._usable = self.alive & self.has_stats & (self.model_id >= 0)
        self._usable_is_alive = None
        self._adaptive = self.adaptive > 0
        self._k_cap = int(self.k_max.max()) if self.size else 0
        seen = self.received_at[self._usable]
        self._oldest = float(seen.min()) if seen.size else np.inf

    def adaptive_mask(self) -> BoolArray:
        if self._usable is None:
            self._refresh_cache()
        assert self._adaptive is not None
        return self._adaptive

    def k_cap(self) -> int:
        if self._usable is None:
            self._refresh_cache()
        return self._k_cap

    def all_fresh(self, fresh: BoolArray) -> bool:
        """Whether ``fresh`` (from ``fresh``) covers every live row."""
        if fresh is self._usable:
            if self._usable_is_alive is None:
                self._usable_is_alive = bool(np.array_equal(self._usable, self.alive))
            return self._usable_is_alive
        return bool(np.array_equal(fresh, self.alive))

    def can_admit(self, prompt_tokens: int) -> BoolArray:
        """Rows that would take a request into the batch now rather than queue it."""
        need = np.ceil((prompt_tokens + 1) / np.maximum(self.block_size, 1))
        ok: BoolArray = (self.eff_slots > 0) & (self.eff_free >= need)
        return ok
