"""Host RAM of one tensor-parallel rank loading its shard: read lazily (each rank reads only
its rows or columns of the memory-mapped safetensors files) against the whole checkpoint read
into memory first (the baseline, in the same run).

Reported per rank: the process's anonymous memory once its shard is loaded and the checkpoint
it read is still held (the peak a rank needs of its own), and its peak resident set, which also
counts the file's page-cache pages the reads touched (reclaimable, shared by every rank on the
node: a row-parallel slice touches every row of a weight, so every page).

Each load runs in a fresh process (peak RSS is per process) over the embedded
SmolLM2-135M-Instruct, whose 3 KV heads allow TP = 3 (or 1):

    .venv/bin/python -m bench.tp_load [--tp 3] [--max-shard-size 100MB]
        [--quantization int8] [--out bench/results/tp_load.json]

With ``--max-shard-size`` the checkpoint is first saved again as a sharded one (several
safetensors files and their index), and each rank reads its slices across the shards.

With ``--quantization int8`` (TP = 1) it compares instead the two ways to quantize at load:
the whole model loaded in full precision and then quantized (the baseline) against each layer
quantized as soon as it is read (``ModelSpec.load``, what serving does). Reported:
the peak anonymous memory during the load (sampled every millisecond from a thread), and what
stays once it is done.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"

CHILD = """
import json, resource, sys
from pathlib import Path
from models.config import LlamaConfig
from models.llama import LlamaModel
from models.parallel import TPContext
from models.weights import load_state_dict, open_checkpoint
from models.host_memory import anon_bytes as anon
folder, rank, tp, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def peak(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before, anon_before = peak(), anon()
model = LlamaModel(LlamaConfig.from_folder(folder), tp=TPContext(rank, tp))
weights = open_checkpoint(folder) if mode == "lazy" else load_state_dict(folder)
model.load_weights(weights)
shard = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak_growth": peak() - before, "anon_growth": anon() - anon_before,
                  "shard_bytes": shard}))
"""

CHILD_QUANT = """
import json, sys, threading, time
from pathlib import Path
from models.quant import Quant
from models.spec import ModelSpec
from models.host_memory import anon_bytes as anon
folder, kind, mode = Path(sys.argv[1]), Quant(sys.argv[2]), sys.argv[3]
high, done = [anon()], threading.Event()
def sample():
    while not done.is_set():
        high[0] = max(high[0], anon())
        time.sleep(0.001)
base = anon()
t = threading.Thread(target=sample, daemon=True)
t.start()
if mode == "at_load":
    model = ModelSpec(str(folder), quantization=kind.value).load()
else:
    model = ModelSpec(str(folder)).load()
    model.quantize(kind)
done.set()
t.join()
high[0] = max(high[0], anon())
print(json.dumps({"peak_anon_growth": high[0] - base, "anon_growth": anon() - base}))
"""


def _load(folder: Path, rank: int, tp: int, mode: str) -> dict[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), str(rank), str(tp), mode],
        check=True,
        capture_output=True,
        text=True,
    )
    got: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def main(argv: list[str] | None = None) -> Path:
    from models.weights import resolve_checkpoint

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument(
        "--max-shard-size",
        default=None,
        help="re-save the checkpoint in shards of at most this size (e.g. 100MB) with an "
        "index, as large checkpoints come, and load that",
    )
    ap.add_argument(
        "--quantization",
        choices=["int8", "fp8"],
        default=None,
        help="compare quantizing after the whole load against layer by layer (TP = 1)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "tp_load.json")
    args = ap.parse_args(argv)
    folder = resolve_checkpoint("embedded")
    with tempfile.TemporaryDirectory() as tmp:
        if args.max_shard_size:
            folder = _sharded(folder, Path(tmp), args.max_shard_size)
        if args.quantization:
            return _measure_quantized(folder, args.quantization, args.out, args.max_shard_size)
        return _measure(folder, args.tp, args.out, args.max_shard_size)


def _measure_quantized(folder: Path, kind: str, out: Path, max_shard_size: str | None) -> Path:
    """Peak and final anonymous memory of quantizing after the load against at load, each in
    a fresh process, alternated over three rounds (the peak of a round is noisy)."""
    from models.weights import safetensors_files

    rounds: list[dict[str, int]] = []
    for _ in range(3):
        row: dict[str, int] = {}
        for mode in ("after", "at_load"):
            got = subprocess.run(
                [sys.executable, "-c", CHILD_QUANT, str(folder), kind, mode],
                check=True,
                capture_output=True,
                text=True,
            )
            r = json.loads(got.stdout.strip().splitlines()[-1])
            row[f"{mode}_peak_anon_bytes"] = r["peak_anon_growth"]
            row[f"{mode}_final_anon_bytes"] = r["anon_growth"]
        rounds.append(row)
        print(json.dumps(row), flush=True)
    after = min(r["after_peak_anon_bytes"] for r in rounds)
    at_load = min(r["at_load_peak_anon_bytes"] for r in rounds)
    doc = {
        "quantization": kind,
        "tp": 1,
        "checkpoint_bytes": sum(f.stat().st_size for f in safetensors_files(folder)),
        "shards": len(safetensors_files(folder)),
        "max_shard_size": max_shard_size,
        "rounds": rounds,
        "after_peak_anon_bytes": after,
        "at_load_peak_anon_bytes": at_load,
        "peak_ratio": at_load / after,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"peak anon: after {after / 2**20:.0f} MiB, at load {at_load / 2**20:.0f} MiB")
    print(f"wrote {out}")
    return out


def _sharded(folder: Path, tmp: Path, max_shard_size: str) -> Path:
    """``folder``'s model saved again in shards of at most ``max_shard_size``, with an index."""
    from transformers import AutoModelForCausalLM

    out = tmp / "sharded"
    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out, max_shard_size=max_shard_size)
    return out


def _measure(folder: Path, tp: int, out: Path, max_shard_size: str | None) -> Path:
    from models.weights import safetensors_files

    shards = safetensors_files(folder)
    files = sum(f.stat().st_size for f in shards)
    ranks: list[dict[str, Any]] = []
    for rank in range(tp):
        row: dict[str, Any] = {"rank": rank}
        for mode in ("whole", "lazy"):
            r = _load(folder, rank, tp, mode)
            row[f"{mode}_anon_bytes"] = r["anon_growth"]
            row[f"{mode}_peak_rss_growth_bytes"] = r["peak_growth"]
            row["shard_bytes"] = r["shard_bytes"]
        row["anon_ratio"] = row["lazy_anon_bytes"] / row["whole_anon_bytes"]
        ranks.append(row)
        print(json.dumps(row), flush=True)
    doc = {
        "tp": tp,
        "checkpoint_bytes": files,
        "shards": len(shards),
        "max_shard_size": max_shard_size,
        "ranks": ranks,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
