"""KV transfer on the device: NIXL READ of 1, 16 and 256 Llama-3-8B-shaped blocks (VRAM to VRAM,
loopback, one rank) against a device memcpy of the same bytes (part of ``bench.gpu_check``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from runtime.runner import synchronize


def kv_transfer(dev: str) -> dict[int, Any]:
    from kvtransfer.handoff import KVCompat, KVHandoff
    from kvtransfer.nixl_transport import NixlTransport
    from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec
    from kvtransfer.transport import PullState

    # Llama-3-8B-shaped blocks on one rank: 32 layers, 8 KV heads, head 128, bf16, 16 tokens.
    spec = KVPoolSpec(512, 16, (KVGroupSpec("target", 32, 8, 128, "bfloat16"),))
    a, b = KVPool(spec, dev), KVPool(spec, dev)
    src, dst = NixlTransport(a, "prefill"), NixlTransport(b, "decode")
    compat = KVCompat("m", "bfloat16", 16, "x", 1, "none", "nixl")
    out: dict[int, Any] = {}
    for n in (1, 16, 256):
        blocks = tuple(range(n))
        nbytes = n * spec.groups[0].block_bytes(16)
        times = []
        for i in range(5):
            h = KVHandoff(f"r{n}-{i}", src.sources(), blocks, ("target",), n * 16, 0, compat, 60.0)
            t0 = time.perf_counter()
            pull = dst.start_pull(h, list(blocks))
            while (state := dst.poll(pull)) is PullState.PENDING:
                src.completed()
            dst.release(pull)
            times.append(time.perf_counter() - t0)
            assert state is PullState.DONE
        x, y = a.tensor("target"), b.tensor("target")
        ctimes = []
        for _ in range(5):
            synchronize(dev)
            t0 = time.perf_counter()
            y[:, :n].copy_(x[:, :n])
            synchronize(dev)
            ctimes.append(time.perf_counter() - t0)
        t_nixl, t_copy = statistics.median(times), statistics.median(ctimes)
        out[n] = {
            "bytes": nbytes,
            "nixl_ms": 1000 * t_nixl,
            "nixl_gbps": nbytes / t_nixl / 1e9,
            "memcpy_ms": 1000 * t_copy,
            "memcpy_gbps": nbytes / t_copy / 1e9,
        }
        assert torch.equal(x[:, :n], y[:, :n])
    return out
