"""What NIXL/UCX itself reaches on this machine: raw READs of the same bytes cut into 1 to 46,080
descriptors, from a second process, against a ``copy_`` of the same bytes.

The ceiling ``bench.kv_transfer`` and ``bench.gpu_check`` are measured against: when a raw
single-descriptor READ is already far below ``copy_``, the gap is the transport UCX picked here
(which ``UCX_PROTO_INFO=y`` prints), not the handoff's layout.

    python -m bench.nixl_ceiling [--device cuda] [--mib 256] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

CHUNKS = (1, 16, 256, 4096, 46080)


def _agent(name: str, threads: int) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, num_threads=threads, backends=["UCX"])
    return nixl_agent(name, cfg)


def _mem(device: str) -> str:
    return "VRAM" if device.startswith("cuda") else "DRAM"


def _source(conn: Connection, nbytes: int, device: str) -> None:
    """The serving side: registers a tensor, hands over its address, serves reads until told."""
    t = torch.ones(nbytes // 4, device=device)
    agent = _agent("source", 0)
    agent.register_memory(t)
    dev_id = t.device.index or 0
    conn.send((agent.get_agent_metadata(), t.data_ptr(), dev_id))
    while not conn.poll():
        agent.get_new_notifs()
    conn.recv()


def measure(nbytes: int, device: str, repeats: int, threads: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_source, args=(there, nbytes, device), daemon=True)
    proc.start()
    try:
        meta, src_ptr, src_dev = here.recv()
        dst = torch.zeros(nbytes // 4, device=device)
        agent = _agent("reader", threads)
        agent.register_memory(dst)
        peer = agent.add_remote_agent(meta)
        mem = _mem(device)
        out: dict[str, Any] = {"bytes": nbytes, "device": device, "num_threads": threads}
        for chunks in CHUNKS:
            size = nbytes // chunks
            local = agent.get_xfer_descs(
                [(dst.data_ptr() + i * size, size, dst.device.index or 0) for i in range(chunks)],
                mem,
            )
            remote = agent.get_xfer_descs(
                [(src_ptr + i * size, size, src_dev) for i in range(chunks)], mem
            )
            times = []
            for _ in range(repeats):
                h = agent.initialize_xfer("READ", local, remote, peer, b"x")
                t0 = time.perf_counter()
                agent.transfer(h)
                while (state := agent.check_xfer_state(h)) == "PROC":
                    pass
                times.append(time.perf_counter() - t0)
                agent.release_xfer_handle(h)
                assert state == "DONE", state
            best = statistics.median(times)
            out[f"{chunks}_descriptors_gb_s"] = nbytes / best / 1e9
            print(chunks, "descriptors", round(nbytes / best / 1e9, 2), "GB/s", flush=True)
        assert bool((dst == 1).all())
        src = torch.ones_like(dst)
        times = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["copy_gb_s"] = nbytes / statistics.median(times) / 1e9
        print("copy_", round(out["copy_gb_s"], 2), "GB/s", flush=True)
        return out
    finally:
        here.send("stop")
        proc.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mib", type=int, default=180)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="the UCX backend's num_threads")
    ap.add_argument("--out", type=Path, default=Path("bench/results/nixl_ceiling.json"))
    args = ap.parse_args()
    nbytes = args.mib * 2**20 // 46080 // 64 * 46080 * 64  # divisible by every chunk count
    res = measure(nbytes, args.device, args.repeats, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
