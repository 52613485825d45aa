"""A tensor-parallel group: rank 0 in the replica's process, ranks 1.. as Ray actors.

Every rank holds its shard of the target's weights (``models.parallel`` layers load their own
rows or columns) and of the KV pool (its KV heads), and a NIXL agent over that pool
(``kvtransfer.tp_transport``). The ranks form a torch.distributed process group of their own
(gloo on CPU, NCCL on CUDA) through a TCP store on rank 0's node; layers issue the
collectives. Rank 0 drives: for each forward it sends the step's batch to the other ranks and
runs its own part, and for each KV pull it asks every rank to read its heads from the matching
source rank. The draft model stays on rank 0.

Actors go into the replica's placement group (bundle ``r`` for rank ``r``) when there is one,
so Ray Serve places a whole group on one node.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvtransfer.handoff import KVHandoff, KVSource
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.tp_transport import GroupTransport, RankPulls
from models.parallel import TPContext
from runtime.runner import LocalRunner, ModelRunner, SeqInput, StepResult
from runtime.shard import Shard, ShardSpec, load_draft, rank_pool, rank_target


def _process_group(spec: ShardSpec, rank: int, host: str, port: int) -> Any:
    """A process group of the TP ranks only, independent of any default group."""
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host, port, spec.tp_size, is_master=rank == 0, use_libuv=False
    )
    if spec.device.startswith("cuda"):
        nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
        return nccl(store, rank, spec.tp_size)
    return dist.ProcessGroupGloo(store, rank, spec.tp_size, timedelta(minutes=5))


class RankWorker:
    """Rank ``r >= 1`` of a TP group (run as a Ray actor): its shard of the target, and its
    side of the group's KV pulls (``RankPulls``, whose methods rank 0 calls)."""

    def __init__(self, spec: ShardSpec, rank: int, host: str, port: int) -> None:
        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)
        self.group = _process_group(spec, rank, host, port)
        self.pool = rank_pool(spec, rank)
        self.runner = rank_target(spec, self.pool, TPContext(rank, spec.tp_size, self.group))
        transport = NixlTransport(self.pool, role=spec.role, rank=rank, tp_size=spec.tp_size)
        self.pulls = RankPulls(transport)

    def run(self, batch: Sequence[SeqInput]) -> None:
        self.runner.run(batch)

    def source(self) -> KVSource:
        return self.pulls.source()

    def start_pull(self, handoff: KVHandoff, blocks: Sequence[int]) -> int:
        return self.pulls.start_pull(handoff, blocks)

    def poll(self, request_ids: Sequence[str]) -> dict[str, str]:
        return self.pulls.poll(request_ids)

    def completed(self) -> list[str]:
        return self.pulls.completed()


class TPRunner(ModelRunner):
    """Runs a step on every rank: the batch goes to ranks 1.. while rank 0 computes."""

    def __init__(self, local: LocalRunner, actors: Sequence[Any]) -> None:
        self.local = local
        self.actors = list(actors)

    def run(self, batch: Sequence[SeqInput]) -> StepResult:
        refs = [a.run.remote(list(batch)) for a in self.actors]
        out = self.local.run(batch)
        ray.get(refs)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def build_tp_shard(spec: ShardSpec) -> Shard:
    """Start ranks 1.. as actors (in the replica's placement group, when there is one), join
    them in a process group, and build rank 0 here."""
    host = ray.util.get_node_ip_address()
    port = _free_port()
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
    group = _process_group(spec, 0, host, port)  # waits for every rank to join
    ray.get([a.source.remote() for a in actors])  # every rank loaded and registered
    pool = rank_pool(spec, 0)
    local = rank_target(spec, pool, TPContext(0, spec.tp_size, group))
    draft = load_draft(spec, pool)
    rank0 = NixlTransport(pool, role=spec.role, rank=0, tp_size=spec.tp_size)
    transport = GroupTransport(rank0, actors)
    shard = Shard(TPRunner(local, actors), draft, pool, transport, spec.tp_size)
    shard.closers.append(lambda: _kill(actors))
    return shard


def _kill(actors: Sequence[Any]) -> None:
    for a in actors:
        ray.kill(a)
