"""Every bucket a replica can step at, run once before it serves: each captures its CUDA graph
and compiles its attention kernels then, so no live step waits on a compile or a capture."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from runtime.bucketed import BucketedRunner
from runtime.runner import ModelRunner, SeqInput
from runtime.step_buffers import Bucket, StepBuffers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmUp:
    """What start-up ran: ``buckets`` steps in ``seconds``, with the compiles and captures."""

    buckets: int
    seconds: float
    compiles: int
    captures: int

    def plus(self, other: WarmUp) -> WarmUp:
        """Both warm-ups (a target's and its drafter's), one after the other."""
        return WarmUp(
            self.buckets + other.buckets,
            self.seconds + other.seconds,
            self.compiles + other.compiles,
            self.captures + other.captures,
        )

    def describe(self) -> str:
        return (
            f"{self.buckets} buckets in {self.seconds:.1f} s ({self.compiles} kernel compiles, "
            f"{self.captures} graph captures)"
        )


def warm_batch(bucket: Bucket, block_size: int) -> list[SeqInput]:
    """``bucket.seqs`` sequences of ``bucket.query`` new tokens (fewer where the blocks must
    also hold a cached one) ending in the last slot of blocks 0..blocks-1, every row's logits
    asked for (a verification's). They write the pool: run only while no block is in use."""
    query = min(bucket.query, bucket.blocks * block_size - 1)
    cached = bucket.blocks * block_size - query
    table = list(range(bucket.blocks))
    return [SeqInput(table, cached, [1] * query, list(range(query))) for _ in range(bucket.seqs)]


def warm_up(runner: ModelRunner, bucketed: BucketedRunner) -> WarmUp:
    """Step ``runner`` (``bucketed``, or a TP group whose rank 0 it is: each step is broadcast)
    once per bucket of ``bucketed``'s grid, logging progress in tenths."""
    return warm_grid(bucketed, lambda b: runner.run(warm_batch(b, bucketed.block_size)), "step")


class Warmable(Protocol):
    buffers: StepBuffers

    @property
    def compiles(self) -> int: ...

    @property
    def captures(self) -> int: ...


def warm_grid(runner: Warmable, step: Callable[[Bucket], object], what: str) -> WarmUp:
    """``step`` once per bucket of ``runner``'s grid, logging progress in tenths."""
    grid = runner.buffers.grid()
    t0 = time.perf_counter()
    compiles, captures = runner.compiles, runner.captures
    log.info("warming up %d %s buckets (graphs and kernels, before serving)", len(grid), what)
    shown = 0
    for i, bucket in enumerate(grid, 1):
        step(bucket)
        if 10 * i // len(grid) > shown:
            shown = 10 * i // len(grid)
            bar = "#" * shown + "." * (10 - shown)
            log.info("warm-up [%s] %d/%d %s buckets, %.1f s", bar, i, len(grid), what, _since(t0))
    done = WarmUp(len(grid), _since(t0), runner.compiles - compiles, runner.captures - captures)
    log.info("warm-up of %s buckets: %s", what, done.describe())
    return done


def _since(t0: float) -> float:
    return time.perf_counter() - t0
