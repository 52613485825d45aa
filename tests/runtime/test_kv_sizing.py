"""Sizing a KV pool from device memory (``runtime.kv_sizing``): the arithmetic, the refusal with
its numbers, where it is refused by name (off a GPU, or a shared GPU), and how a TP group's
ranks agree on one size. The sizing itself runs on a GPU (tests/gpu)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from pydantic import ValidationError
from torch.distributed.distributed_c10d import PrefixStore

from cluster.config import TandemConfig
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.spec import DraftSpec, ModelSpec
from runtime.kv_sizing import DeviceMemory, KVSizingError, blocks_for_memory, profile_steps
from runtime.ports import free_port
from runtime.shard import ShardSpec

GIB = 2**30
MIB = 2**20


def test_the_pool_takes_the_share_left_in_whole_blocks() -> None:
    mem = DeviceMemory(total=80 * GIB, in_use=18 * GIB, step_peak=2 * GIB)
    # 0.9 * 80 - 18 - 2 = 52 GiB of 2 MiB blocks
    assert blocks_for_memory(mem, 0.9, 2 * MIB, 1024, "decode") == 52 * 512
    assert blocks_for_memory(mem, 0.9, 3 * MIB, 1024, "decode") == (52 * 1024) // 3
    lower = blocks_for_memory(mem, 0.5, 2 * MIB, 1024, "decode")
    assert lower == (40 - 20) * 512 < 52 * 512


def test_too_little_memory_for_the_floor_is_refused_with_the_numbers() -> None:
    mem = DeviceMemory(total=80 * GIB, in_use=70 * GIB, step_peak=3 * GIB)
    with pytest.raises(KVSizingError) as e:
        blocks_for_memory(mem, 0.9, 2 * MIB, 4096, "decode")
    msg = str(e.value)
    for part in (
        "decode.gpu_memory_utilization 0.9",
        "80.0 GiB",
        "70.00 GiB in use",
        "3.00 GiB",
        "fewer than decode.num_blocks (4096)",
    ):
        assert part in msg, msg
    over = DeviceMemory(total=80 * GIB, in_use=75 * GIB, step_peak=0)  # past the share already
    with pytest.raises(KVSizingError, match=r"0\.00 GiB for KV"):
        blocks_for_memory(over, 0.9, 2 * MIB, 1, "prefill")


def test_the_probe_pool_holds_the_largest_steps(tiny_folder: Path) -> None:
    spec = ShardSpec(
        "decode",
        ModelSpec(str(tiny_folder)),
        DraftSpec(),
        num_blocks=4096,
        block_size=16,
        memory_utilization=0.9,
    )
    probe, blocks = profile_steps(spec, tokens=2048, seqs=64, query=5)
    assert blocks == max(2048 // 16, 64 * 1) + 1 == probe.num_blocks
    assert probe.memory_utilization is None and probe.buckets is None
    _, wide = profile_steps(spec, tokens=100, seqs=64, query=20)  # 20 tokens: 2 blocks each
    assert wide == 64 * 2 + 1


def test_off_a_gpu_sizing_is_refused_by_name(tiny_folder: Path) -> None:
    cfg = DecodeEngineConfig(
        "t", ModelSpec(str(tiny_folder)), num_blocks=64, gpu_memory_utilization=0.9
    )
    with pytest.raises(
        ValueError, match=r"decode\.gpu_memory_utilization sizes the KV pool from GPU"
    ):
        DecodeEngine(cfg)
    base = {"model": {"source": str(tiny_folder)}}
    for pool, why in (
        ({"device": "cpu"}, "on device cpu set num_blocks"),
        ({"device": "cuda", "gpu_fraction": 0.5}, "sharing a GPU"),
    ):
        with pytest.raises(ValidationError, match=why):
            TandemConfig.model_validate(base | {"decode": pool | {"gpu_memory_utilization": 0.9}})
    for pool in ({"device": "cuda"}, {"device": "cuda", "tp": 2}):
        ok = TandemConfig.model_validate(base | {"decode": pool | {"gpu_memory_utilization": 0.9}})
        assert ok.decode.gpu_memory_utilization == 0.9


@pytest.mark.parametrize("fits", [True, False])
def test_a_tp_groups_ranks_take_the_fewest_blocks_any_rank_holds(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch, fits: bool
) -> None:
    """Each rank sizes its own pool (rank 0's also holds the draft's KV and weights); the ranks
    agree over their CPU group on the fewest blocks, so block ids mean the same everywhere. A
    rank below num_blocks fails every rank, not only itself (the others would wait on it).
    The measurement is a GPU's: here each rank's count stands in for it, over a real gloo
    group of two threads."""
    from runtime import kv_sizing

    spec = ShardSpec(
        "decode",
        ModelSpec(str(tiny_folder)),
        DraftSpec(),
        64,
        16,
        "cuda",
        2,
        memory_utilization=0.9,
    )
    counts = {0: 900, 1: 800 if fits else -1}

    def measured(spec: ShardSpec, model: object, *args: int) -> int:
        n = counts[args[-1]]
        if n < 0:
            raise KVSizingError(f"rank {args[-1]}: 12 blocks, fewer than decode.num_blocks (64)")
        return n

    monkeypatch.setattr(kv_sizing, "size_pool", measured)
    port = free_port()
    got: dict[int, ShardSpec | Exception] = {}

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=r == 0, use_libuv=False)
        group = dist.ProcessGroupGloo(PrefixStore("s/", store), r, 2, timedelta(seconds=60))
        try:
            got[r] = kv_sizing.sized_rank(spec, None, r, group)  # type: ignore[arg-type]
        except KVSizingError as e:
            got[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if fits:
        assert all(isinstance(g, ShardSpec) and g.num_blocks == 800 for g in got.values())
        assert all(isinstance(g, ShardSpec) and g.memory_utilization is None for g in got.values())
    else:
        assert "rank 1: 12 blocks" in str(got[1])
        assert "another rank of this TP group cannot hold decode.num_blocks (64)" in str(got[0])
