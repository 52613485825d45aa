"""A tensor-parallel group: rank 0 broadcasts each step's inputs; ranks 1.. are Ray actors
(bundle ``r`` of the placement group) looping on them; KV pulls are a Ray call per request."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed.distributed_c10d import PrefixStore

from kvtransfer.handoff import KVHandoff, KVSource
from kvtransfer.memory import process_memory
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.path_check import PathProbe
from kvtransfer.tp_transport import GroupTransport, RankPulls
from models.parallel import TPContext
from runtime.kv_sizing import sized_rank
from runtime.ports import free_port
from runtime.runner import LocalRunner, ModelRunner, SeqInput, StepResult
from runtime.shard import (
    Shard,
    ShardSpec,
    load_draft,
    load_draft_model,
    load_target,
    rank_pool,
    target_runner,
)
from runtime.step_wire import pack, unpack

log = logging.getLogger(__name__)


IDLE_TIMEOUT = timedelta(days=365)  # ranks wait for rank 0's next step as long as it idles


@dataclass(frozen=True)
class Groups:
    """The layers' collectives, and a gloo group for step inputs, apart because ranks wait on it
    while the replica idles; the layers' keep a timeout that catches a hung rank."""

    compute: Any
    steps: Any


def _process_groups(spec: ShardSpec, rank: int, host: str, port: int) -> Groups:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, spec.tp_size, is_master=rank == 0, use_libuv=False
    )
    steps = dist.ProcessGroupGloo(PrefixStore("steps/", store), rank, spec.tp_size, IDLE_TIMEOUT)
    if spec.device.startswith("cuda"):
        nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
        return Groups(nccl(PrefixStore("compute/", store), rank, spec.tp_size), steps)
    compute = dist.ProcessGroupGloo(
        PrefixStore("compute/", store), rank, spec.tp_size, timedelta(minutes=5)
    )
    return Groups(compute, steps)


STOP = -1


class StepChannel:
    """Each step's inputs from rank 0: the layout over the steps group (gloo, from the host);
    tokens still on the device (drafts or sampled tokens not read) over the compute group
    (NCCL on a GPU: queued on the stream, no host sync)."""

    def __init__(self, group: Any, compute: Any, device: torch.device) -> None:
        self.group, self.compute, self.device = group, compute, device

    def send(self, batch: Sequence[SeqInput] | None, ids: torch.Tensor | None = None) -> None:
        """Rank 0: the next step's inputs (None: stop); ``ids``: [T] its tokens on the device."""
        flat = pack(batch) if batch is not None else None
        n = STOP if flat is None else flat.numel()
        size = torch.tensor([n, 0 if ids is None else ids.numel()])
        self.group.broadcast(size, 0).wait()
        if flat is not None:
            self.group.broadcast(flat, 0).wait()
        if ids is not None:
            self.compute.broadcast(ids.contiguous(), 0).wait()

    def receive(self) -> tuple[list[SeqInput], torch.Tensor | None] | None:
        """Ranks 1..: the next step's inputs and device tokens, or None when rank 0 stopped."""
        size = torch.empty(2, dtype=torch.long)
        self.group.broadcast(size, 0).wait()
        n, t = size.tolist()
        if n == STOP:
            return None
        flat = torch.empty(n, dtype=torch.long)
        self.group.broadcast(flat, 0).wait()
        ids = None
        if t:
            ids = torch.empty(t, dtype=torch.long, device=self.device)
            self.compute.broadcast(ids, 0).wait()
        return unpack(flat), ids


class RankWorker:
    """Rank r >= 1: one loop thread builds and steps its shard (one OpenMP team)."""

    def __init__(self, spec: ShardSpec, rank: int, host: str, port: int) -> None:
        self.groups = _process_groups(spec, rank, host, port)
        self.steps = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop = threading.Thread(target=self._run_steps, args=(spec, rank), daemon=True)
        self._loop.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"TP rank {rank} could not load its shard") from self._error

    def _build(self, spec: ShardSpec, rank: int) -> None:
        spec.configure_process()
        tp = TPContext(rank, spec.tp_size, self.groups.compute)
        model = load_target(spec, tp)
        spec = sized_rank(spec, model, rank, self.groups.steps)  # beside the other ranks
        self.pool = rank_pool(spec, rank)
        self.runner = target_runner(spec, model, self.pool)
        fabric = spec.resolve_fabric()
        transport = NixlTransport(
            self.pool, role=spec.role, rank=rank, tp_size=spec.tp_size, backend=fabric.backend
        )
        self.pulls = RankPulls(transport)
        self.channel = StepChannel(self.groups.steps, self.groups.compute, self.pool.device)

    def _run_steps(self, spec: ShardSpec, rank: int) -> None:
        try:
            self._build(spec, rank)
        except BaseException as e:
            self._error = e
            return
        finally:
            self._ready.set()
        try:
            while (got := self.channel.receive()) is not None:
                self.runner.run(*got)
                self.steps += 1
        except Exception:  # the group broke (rank 0 gone): nothing more will come
            log.exception("TP rank step loop ended")

    def peak_rss_bytes(self) -> int:
        return process_memory()["peak_rss_bytes"]

    def source(self) -> KVSource:
        return self.pulls.source()

    def start_pull(self, handoff: KVHandoff, blocks: Sequence[int]) -> int:
        return self.pulls.start_pull(handoff, blocks)

    def poll(self, request_ids: Sequence[str]) -> dict[str, str]:
        return self.pulls.poll(request_ids)

    def completed(self) -> list[str]:
        return self.pulls.completed()

    def release(self, request_ids: Sequence[str]) -> list[str]:
        return self.pulls.release(request_ids)

    def outstanding(self) -> int:
        return self.pulls.outstanding()


class TPRunner(ModelRunner):
    takes_device_ids = True

    def __init__(self, local: LocalRunner, channel: StepChannel) -> None:
        self.local = local
        self.channel = channel

    def run(self, batch: Sequence[SeqInput], ids: torch.Tensor | None = None) -> StepResult:
        self.channel.send(batch, ids)
        return self.local.run(batch, ids)

    def describe(self) -> dict[str, str | int]:
        return self.local.describe()

    def rank0(self) -> ModelRunner:
        return self.local

    def stop(self) -> None:
        """End the ranks' step loops (before the group is torn down)."""
        self.channel.send(None)


def build_tp_shard(spec: ShardSpec) -> Shard:
    """Start ranks 1.. and build rank 0; ValueError for object_store (single ranks only)."""
    if spec.transport == "object_store":
        raise ValueError(f"kv.transport=object_store needs TP = 1; this shard has {spec.tp_size}")
    host = ray.util.get_node_ip_address()
    port = free_port()
    pg = ray.util.get_current_placement_group()
    actors: list[Any] = []
    for rank in range(1, spec.tp_size):
        opts: dict[str, Any] = {"num_cpus": 0}
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, rank)
        if spec.device.startswith("cuda"):
            opts["num_gpus"] = 1
        actor_cls = ray.remote(RankWorker)
        actors.append(actor_cls.options(**opts).remote(spec, rank, host, port))
    try:
        return _build_rank0(spec, host, port, actors)
    except BaseException:  # the ranks already started would outlive the failed replica
        _kill(actors)
        raise


def _build_rank0(spec: ShardSpec, host: str, port: int, actors: list[Any]) -> Shard:
    groups = _process_groups(spec, 0, host, port)
    # beside the ranks' loads, not after them: a quantized load runs collectives (row maxima
    # over the group's columns), so each side would wait on the other; so does the sizing
    model = load_target(spec, TPContext(0, spec.tp_size, groups.compute))
    # the draft (rank 0's) counts in what its pool is sized after
    loaded = load_draft_model(spec) if spec.memory_utilization is not None else None
    spec = sized_rank(spec, model, 0, groups.steps)
    pool = rank_pool(spec, 0)
    local = target_runner(spec, model, pool)
    ray.get([a.source.remote() for a in actors])  # every rank loaded (or its error raised)
    draft = load_draft(spec, pool, loaded)
    fabric = spec.resolve_fabric()
    rank0 = NixlTransport(
        pool, role=spec.role, rank=0, tp_size=spec.tp_size, backend=fabric.backend
    )
    transport = GroupTransport(rank0, actors)
    runner = TPRunner(local, StepChannel(groups.steps, groups.compute, pool.device))
    probe = (
        PathProbe(fabric, spec.device, spec.min_path_gbps, spec.role) if spec.path_check else None
    )
    shard = Shard(runner, draft, pool, transport, spec.tp_size, fabric=fabric, path=probe)
    shard.closers.append(runner.stop)
    shard.closers.append(lambda: _kill(actors))
    log.info("%s shard over %d ranks: %s", spec.role, spec.tp_size, runner.describe())
    return shard


def _kill(actors: Sequence[Any]) -> None:
    for a in actors:
        ray.kill(a)
