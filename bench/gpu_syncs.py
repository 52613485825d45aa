"""Device-to-host synchronisations per decode step, by drafter (``bench.gpu_check`` section
``syncs``; issue 53's goal is one a step, drafting included). Each steady decode step of the
engine runs under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every operation
that waits on the device (an ``.item()`` or ``.tolist()``, a synchronous copy, a
``nonzero``); the warnings are counted per step and their Python call sites tallied. Greedy
and sampled requests share the batch. On a CPU nothing waits on a device; there the tensor
methods that hand the host a value (``tolist``, ``item``, ``int()`` ...) are counted instead,
the reads a GPU would wait on (a blocking copy would be missed: the GPU run counts those).

    python -m bench.gpu_syncs --models DIR   (DIR: ``bench.gpu_check.make_models``' folder)
"""

from __future__ import annotations

import argparse
import json
import statistics
import traceback
import uuid
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

STEPS = 12


def _drafters(models: Path) -> dict[str, Any]:
    """By name, each engine's drafter (``plain_overlap``: no drafter, ``decode.overlap`` on)."""
    from models.spec import DraftKind, DraftSpec, ModelSpec

    draft, eagle = ModelSpec(str(models / "d")), ModelSpec(str(models / "e"))
    return {
        "plain": DraftSpec(),
        "plain_overlap": DraftSpec(),
        "ngram": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4, adaptive=False),
        "draft_model": DraftSpec(
            DraftKind.DRAFT_MODEL, model=draft, num_speculative_tokens=4, adaptive=False
        ),
        "eagle": DraftSpec(DraftKind.EAGLE, model=eagle, num_speculative_tokens=4, adaptive=False),
        "eagle_tree": DraftSpec(
            DraftKind.EAGLE, model=eagle, num_speculative_tokens=4, adaptive=False, tree_width=3
        ),
    }


READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")


def _count_reads(step: Any) -> tuple[int, list[str]]:
    """The host reads of tensor values ``step()`` makes, and where (a CPU's stand-in)."""
    sites: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any) -> Any:
            caller = traceback.extract_stack(limit=2)[0]
            sites.append(f"{Path(caller.filename).name}:{caller.lineno}")
            return saved[name](self, *args)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        step()
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
    return len(sites), sites


def _count(dev: str, step: Any) -> tuple[int, list[str]]:
    """The syncs ``step()`` makes, and where, under the sync debug mode (on a CPU: its reads)."""
    if dev != "cuda":
        return _count_reads(step)
    from models.device_copy import HostCopy

    waits: list[str] = []
    read = HostCopy.tolist

    def waited(self: HostCopy) -> list[int]:  # an event wait: the sync debug mode misses it
        waits.append("HostCopy.tolist")
        return read(self)

    HostCopy.tolist = waited  # type: ignore[method-assign]
    try:
        n, sites = _count_syncs(step)
    finally:
        HostCopy.tolist = read  # type: ignore[method-assign]
    return n + len(waits), sites + waits


def _count_syncs(step: Any) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = [f"{Path(w.filename).name}:{w.lineno}" for w in got if "synchroniz" in str(w.message)]
    return len(sites), sites


def measure(models: Path, dev: str) -> dict[str, Any]:
    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.request import Request
    from models.sampling import SamplingParams
    from models.spec import ModelSpec

    target = ModelSpec(str(models / "t"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4000, (40,), generator=g).tolist() for _ in range(8)]
    prompts[0] = prompts[0][:10] * 4  # something n-gram lookup predicts
    counted = "device syncs" if dev == "cuda" else "host reads of tensor values"
    out: dict[str, Any] = {"measured": dev == "cuda", "counted": counted, "steps": STEPS}
    out["drafters"] = {}
    for name, spec in _drafters(models).items():
        # 256-token sequences: a small grid of buckets, every one captured before the count
        cfg = DecodeEngineConfig(
            "t",
            target,
            spec,
            device=dev,
            num_blocks=256,
            max_batch_size=8,
            max_model_len=256,
            overlap="on" if name == "plain_overlap" else "off",
        )
        engine = DecodeEngine(cfg)
        reqs = [
            Request(
                uuid.uuid4().hex,
                p,
                SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=STEPS * 6 + 8),
            )
            for i, p in enumerate(prompts)
        ]
        for r in reqs:
            engine.add(r, None)
        while any(not r.output_token_ids for r in reqs):  # prompts and first tokens
            engine.step()
        counts, sites = [], Counter[str]()
        for _ in range(STEPS):
            n, where = _count(dev, engine.step)
            counts.append(n)
            sites.update(where)
        engine.close()
        out["drafters"][name] = {
            "syncs_per_step_median": statistics.median(counts),
            "syncs_per_step_max": max(counts),
            "sites": dict(sites.most_common(12)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", type=Path, required=True)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps(measure(args.models, dev), indent=2))


if __name__ == "__main__":
    main()
