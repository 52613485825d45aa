"""Sizing a KV pool from device memory (``runtime.kv_sizing``): the arithmetic, the refusal with
its numbers, and where it is refused by name (off a GPU, with tp > 1 or a shared GPU). The
sizing itself runs on a GPU (tests/gpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import TandemConfig
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.spec import DraftSpec, ModelSpec
from runtime.kv_sizing import DeviceMemory, KVSizingError, blocks_for_memory, profile_steps
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
        ({"device": "cuda", "tp": 2}, "tp 1 only"),
        ({"device": "cuda", "gpu_fraction": 0.5}, "sharing a GPU"),
    ):
        with pytest.raises(ValidationError, match=why):
            TandemConfig.model_validate(base | {"decode": pool | {"gpu_memory_utilization": 0.9}})
    ok = TandemConfig.model_validate(
        base | {"decode": {"device": "cuda", "gpu_memory_utilization": 0.9}}
    )
    assert ok.decode.gpu_memory_utilization == 0.9
