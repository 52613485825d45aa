"""A GPU replica's KV pool sized from device memory (``gpu_memory_utilization``): the models
loaded, the largest step profiled over a small pool, and the memory left under the utilization
given to the pool, in whole blocks; never fewer than the configured ``num_blocks``."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from models.llama import LlamaModel
from runtime.runner import SeqInput
from runtime.shard import ShardSpec, rank_pool, target_runner

log = logging.getLogger(__name__)
GIB = 2**30


class KVSizingError(ValueError):
    """The models and the largest step leave too little memory for the pool's floor."""


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes the device has
    in_use: int  # bytes in use on it (every process's), the models loaded, no pool
    step_peak: int  # bytes the largest step needed beyond what stays allocated


def blocks_for_memory(
    mem: DeviceMemory, utilization: float, block_bytes: int, floor: int, role: str
) -> int:
    """Whole blocks in ``utilization`` of the device less what is in use and the step's peak;
    KVSizingError, with the numbers, below ``floor``."""
    budget = utilization * mem.total - mem.in_use - mem.step_peak
    blocks = max(0, math.floor(budget / block_bytes))
    if blocks < floor:
        raise KVSizingError(
            f"{role}.gpu_memory_utilization {utilization:g} of {mem.total / GIB:.1f} GiB leaves "
            f"{max(budget, 0) / GIB:.2f} GiB for KV after {mem.in_use / GIB:.2f} GiB in use "
            f"(the models loaded) and a {mem.step_peak / GIB:.2f} GiB step: {blocks} blocks of "
            f"{block_bytes / 2**20:.2f} MiB, fewer than {role}.num_blocks ({floor}); raise the "
            "utilization, lower num_blocks, or shard the model (tp)"
        )
    return blocks


def measure_cuda(device: torch.device, step: Callable[[], None]) -> DeviceMemory:
    """What ``step`` peaks at beyond what stays allocated, and the device's use afterwards."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total, total - free, peak)


def profile_steps(spec: ShardSpec, tokens: int, seqs: int, query: int) -> tuple[ShardSpec, int]:
    """The spec of a pool just large enough for the largest steps (a ``tokens``-token prompt
    chunk; ``seqs`` sequences of ``query`` tokens, every row's logits), and its blocks."""
    bs = spec.block_size
    blocks = max(math.ceil(tokens / bs), seqs * math.ceil(query / bs)) + 1
    return replace(spec, num_blocks=blocks, buckets=None, memory_utilization=None), blocks


def check_sizable(spec: ShardSpec) -> None:
    """ValueError where ``spec`` asks for its pool sized from memory off a GPU."""
    if spec.memory_utilization is not None and not spec.device.startswith("cuda"):
        raise ValueError(
            f"{spec.role}.gpu_memory_utilization sizes the KV pool from GPU memory; on "
            f"{spec.device} set {spec.role}.num_blocks instead"
        )


def size_pool(
    spec: ShardSpec, model: LlamaModel, tokens: int, seqs: int, query: int, rank: int = 0
) -> int:
    """Blocks for ``spec``'s pool on its GPU, ``model`` (the target, or TP rank ``rank``'s
    shard of it: every rank profiles the same steps at once, their collectives in step)
    loaded with the draft; ValueError off a GPU."""
    assert spec.memory_utilization is not None
    check_sizable(spec)
    mem, block_bytes = _profile(spec, model, tokens, seqs, query, rank)
    got = blocks_for_memory(mem, spec.memory_utilization, block_bytes, spec.num_blocks, spec.role)
    log.info(
        "%s KV pool (rank %d) sized from memory: %d blocks (%.2f GiB) of %.1f GiB at "
        "utilization %g; %.2f GiB in use with the models, a %.2f GiB step",
        spec.role,
        rank,
        got,
        got * block_bytes / GIB,
        mem.total / GIB,
        spec.memory_utilization,
        mem.in_use / GIB,
        mem.step_peak / GIB,
    )
    return got


def agree_blocks(blocks: int, group: Any) -> int:
    """The fewest blocks any rank of ``group`` (a CPU process group, every rank calling) can
    hold: a TP group's pools all have one size, so block ids mean the same on every rank."""
    t = torch.tensor([blocks], dtype=torch.long)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    group.allreduce([t], opts).wait()
    return int(t.item())


def _profile(
    spec: ShardSpec, model: LlamaModel, tokens: int, seqs: int, query: int, rank: int
) -> tuple[DeviceMemory, int]:
    """The largest steps over a probe pool: the device's memory without that pool, and the
    bytes of one block."""
    probe, blocks = profile_steps(spec, tokens, seqs, query)
    pool = rank_pool(probe, rank)
    runner = target_runner(probe, model, pool)
    bs = spec.block_size
    per = math.ceil(query / bs)
    chunk = SeqInput(list(range(1, math.ceil(tokens / bs) + 1)), 0, [1] * tokens, [tokens - 1])
    rows = [
        SeqInput(list(range(1 + i * per, 1 + (i + 1) * per)), 0, [1] * query, list(range(query)))
        for i in range(seqs)
    ]

    def largest_steps() -> None:
        runner.run([chunk])
        runner.run(rows)

    mem = measure_cuda(torch.device(spec.device), largest_steps)
    return replace(mem, in_use=mem.in_use - pool.nbytes), pool.nbytes // blocks


def sized_rank(spec: ShardSpec, model: LlamaModel, rank: int, group: Any) -> ShardSpec:
    """``spec`` with the blocks every rank of a TP group can hold (``sized_rank`` runs on each
    at once, ``group`` the ranks' CPU group); as it is where its pool is not sized from
    memory. A rank that cannot hold ``num_blocks`` fails every rank's start-up with its numbers."""
    if spec.memory_utilization is None:
        return spec
    error: KVSizingError | None = None
    try:
        blocks = size_pool(
            spec, model, spec.profile_tokens, spec.profile_seqs, spec.profile_query, rank
        )
    except KVSizingError as e:
        blocks, error = -1, e
    agreed = agree_blocks(blocks, group)
    if error is not None:
        raise error
    if agreed < 0:
        raise KVSizingError(
            f"{spec.role}.gpu_memory_utilization: another rank of this TP group cannot hold "
            f"{spec.role}.num_blocks ({spec.num_blocks}); its log has the numbers"
        )
    return replace(spec, num_blocks=agreed, memory_utilization=None)
