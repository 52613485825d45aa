"""KV transfer on the device: NIXL READ of 1, 16 and 256 Llama-3-8B-shaped blocks (VRAM to VRAM
on a GPU) against a device copy of the same bytes (part of ``bench.gpu_check``).

Two arrangements:

- ``loopback``: both agents in one process (what the first GPU run measured);
- ``two_process``: the source agent in a child process, as a prefill and a decode replica are
  deployed. CUDA IPC maps another process's device memory, so this is where UCX can pick
  ``cuda_ipc`` for VRAM; within one process it may fall back to staging through the host.

Run as a module it measures one arrangement under the UCX settings of its environment and
writes JSON; ``bench.gpu_check`` runs it once per setting with ``UCX_PROTO_INFO=y`` and keeps
what UCX printed about the protocols it chose. Every pull's bytes are checked against the
pattern the source wrote.

    python -m bench.gpu_kv --mode two_process --out kv.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec
from runtime.runner import synchronize

SIZES = (1, 16, 256)


def pool_spec(num_blocks: int) -> KVPoolSpec:
    """Llama-3-8B-shaped blocks on one rank: 32 layers, 8 KV heads, head 128, bf16, 16 tokens."""
    return KVPoolSpec(num_blocks, 16, (KVGroupSpec("target", 32, 8, 128, "bfloat16"),))


def _pattern(t: torch.Tensor, layer: int) -> torch.Tensor:
    """What the source writes into one layer [NB, 2, Hkv, BS, D] of its pool: small integers
    (exact in bf16) that differ by layer, block, K/V, head, token and channel."""
    idx = [torch.arange(n, device=t.device) for n in t.shape[1:]]  # per dim of one layer
    v = torch.full((1,) * 5, layer * 31, device=t.device)
    for dim, (i, mult) in enumerate(zip(idx, (7, 3, 5, 11, 1), strict=True)):
        shape = [1] * 5
        shape[dim] = -1
        v = v + mult * i.view(shape)
    return (v % 199).to(t.dtype)  # [NB, 2, Hkv, BS, D]


def _fill(pool: KVPool) -> None:
    t = pool.tensor("target")  # [L, NB, 2, Hkv, BS, D]
    for layer in range(t.shape[0]):
        t[layer].copy_(_pattern(t, layer))


SOURCE_PROGRESS = ("poll", "busy", "thread")


def _source_main(conn: Connection, dev: str, num_blocks: int, progress: str) -> None:
    """The child of ``two_process``: a filled pool behind a NIXL agent, served until told to
    stop. ``progress``: how the source lets UCX progress: ``poll`` calls ``completed()``
    between waits of 0.5 ms (as a prefill replica's loop does between steps), ``busy`` without
    waiting, ``thread`` leaves it to NIXL's progress thread."""
    from kvtransfer.nixl_transport import NixlTransport

    pool = KVPool(pool_spec(num_blocks), dev)
    _fill(pool)
    synchronize(dev)
    src = NixlTransport(pool, "prefill", progress_thread=progress == "thread")
    conn.send(src.sources())
    wait = {"poll": 0.0005, "busy": 0.0, "thread": 0.01}[progress]
    while not conn.poll(wait):
        src.completed()
    src.close()


def kv_transfer(
    dev: str, mode: str = "loopback", num_blocks: int = 512, source_progress: str = "poll"
) -> dict[str, Any]:
    """Median NIXL pull time of each size in ``SIZES`` under ``mode`` (module docstring), with a
    device copy of the same blocks through the pools' views (``strided_copy``) and a flat copy
    of as many bytes (the device's ceiling) measured in the same run."""
    from kvtransfer.handoff import KVCompat, KVHandoff
    from kvtransfer.nixl_transport import NixlTransport
    from kvtransfer.transport import PullState

    spec = pool_spec(num_blocks)
    dst_pool = KVPool(spec, dev)
    dst = NixlTransport(dst_pool, "decode")
    pump: Callable[[], object]
    child: Any = None
    if mode == "loopback":
        src_pool = KVPool(spec, dev)
        _fill(src_pool)
        src = NixlTransport(src_pool, "prefill")
        sources = src.sources()
        pump = src.completed
    elif mode == "two_process":
        ctx = mp.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        child = ctx.Process(
            target=_source_main,
            args=(child_conn, dev, num_blocks, source_progress),
            daemon=True,
        )
        child.start()
        if not conn.poll(120):
            raise RuntimeError("the source process sent no NIXL metadata in 120 s")
        sources = conn.recv()
        src_pool = KVPool(spec, dev)  # the same pattern here, for the copies and the check
        _fill(src_pool)

        def pump() -> None:
            return None

    else:
        raise ValueError(f"mode {mode!r} is not loopback or two_process")
    compat = KVCompat("m", "bfloat16", 16, "x", 1, "none", "nixl")
    x, y = src_pool.tensor("target"), dst_pool.tensor("target")
    flat_x = src_pool.memory("target").view(-1)
    flat_y = dst_pool.memory("target").view(-1)
    out: dict[str, Any] = {
        "mode": mode,
        "source_progress": source_progress if mode == "two_process" else "loopback",
        "mem_type": dst_pool.mem_type,
        "sizes": {},
    }
    for n in SIZES:
        blocks = tuple(range(n))
        nbytes = n * spec.groups[0].block_bytes(16)
        times = []
        for i in range(5):
            y[:, :n].zero_()
            synchronize(dev)
            h = KVHandoff(f"r{n}-{i}", sources, blocks, ("target",), n * 16, 0, compat, 60.0)
            t0 = time.perf_counter()
            pull = dst.start_pull(h, list(blocks))
            while (state := dst.poll(pull)) is PullState.PENDING:
                pump()
            times.append(time.perf_counter() - t0)
            dst.release(pull)
            assert state is PullState.DONE, f"{n} blocks: pull ended {state}"
        assert torch.equal(x[:, :n], y[:, :n]), f"{n} blocks: pulled bytes differ from the source"

        def timed(copy: Callable[[], object]) -> float:
            ts = []
            for _ in range(5):
                synchronize(dev)
                t0 = time.perf_counter()
                copy()
                synchronize(dev)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        elems = nbytes // x.element_size()
        t_nixl = statistics.median(times)
        t_strided = timed(partial(y[:, :n].copy_, x[:, :n]))
        t_flat = timed(partial(flat_y[:elems].copy_, flat_x[:elems]))
        out["sizes"][n] = {
            "bytes": nbytes,
            "nixl_ms": 1000 * t_nixl,
            "nixl_gbps": nbytes / t_nixl / 1e9,
            "strided_copy_gbps": nbytes / t_strided / 1e9,
            "flat_copy_gbps": nbytes / t_flat / 1e9,
            "nixl_over_flat_copy": t_flat / t_nixl,
        }
    if child is not None:
        conn.send("stop")
        child.join(30)
    dst.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", choices=("loopback", "two_process"), default="loopback")
    ap.add_argument("--blocks", type=int, default=512, help="blocks per pool (>= 256)")
    ap.add_argument("--source-progress", choices=SOURCE_PROGRESS, default="poll")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = kv_transfer(dev, args.mode, args.blocks, args.source_progress)
    print(json.dumps(res), flush=True)
    args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
