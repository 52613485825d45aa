"""Is speculation as good disaggregated as colocated? The same ShareGPT chat histories, at
about 1k, 4k and 7k prompt tokens (the embedded model's window is 8k), are served greedily by
the in-process engines: colocated (decode computes the prompt) and disaggregated (prefill computes
it and the target KV, the draft KV and the EAGLE feature travel over NIXL to decode), with the
shipped EAGLE head behind n-gram lookup and with the head alone, k = 4 fixed. Reported per
length: mean accepted length (tokens per verifying forward) and acceptance, and the ratio
disaggregated / colocated (the goal: at least 0.98), with the outputs compared token for token.

A third arm shows what engines that ship only the target KV lose (TensorRT-LLM measured it; vLLM
and SGLang have it open): the prefill replica's draft-head KV is zeroed before decode pulls it,
so decode's head attends over what its pool holds when only the target KV arrives (zeros here,
the benign case of stale slots); the head's last feature still ships. An EAGLE head's prompt KV
cannot be recomputed on decode without the target's hidden states for the whole prompt, which is
the target's own prefill again.

    .venv/bin/python -m bench.disagg_acceptance [--per-length 3] [--max-tokens 64]
        [--lengths 1024 4096 7168] [--drafters eagle] [--merge] [--out bench/results/...json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import uuid
from pathlib import Path
from typing import Any

from bench.sharegpt import iter_conversations
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.embedded import embedded_eagle_path
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker

RESULTS = Path(__file__).parent / "results"
LENGTHS = (1024, 4096, 7168)
ROLES = {"human": "user", "gpt": "assistant"}


def _prompts(tok: Tokenizer, length: int, count: int) -> list[list[int]]:
    """Chat histories of consecutive ShareGPT conversations (one long session), cut at a user
    turn within 15 % under ``length`` tokens."""
    out: list[list[int]] = []
    msgs: list[dict[str, str]] = []
    for conv in iter_conversations():
        for speaker, text in conv.turns:
            role = ROLES.get(speaker)
            if role is None or (msgs and msgs[-1]["role"] == role):
                continue  # keep the roles alternating across conversations
            if not msgs and role != "user":
                continue
            msgs.append({"role": role, "content": text})
            if role != "user":
                continue
            ids = tok.apply_chat_template(msgs)
            if len(ids) > length:
                msgs = []  # overshot: start another session
            elif len(ids) >= 0.85 * length:
                out.append(ids)
                msgs = []
                if len(out) == count:
                    return out
    raise RuntimeError(f"found only {len(out)} histories near {length} tokens")


def _serve(
    engine: DecodeEngine,
    prefill: PrefillWorker | None,
    prompts: list[list[int]],
    max_tokens: int,
    ship_draft_kv: bool = True,
) -> tuple[list[list[int]], dict[str, float]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=())
    reqs = [Request(uuid.uuid4().hex, p, sp) for p in prompts]
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in reqs:  # one at a time: each request's acceptance, not the batch's
        handoff = None
        if prefill is not None:
            handoff = prefill.prefill(r)
            out[r.request_id].append(handoff.first_token)
            if not ship_draft_kv:  # [NB, L, 2, H, BS, D]: the handoff's blocks of the head's KV
                prefill.pool.memory("draft")[list(handoff.block_ids)] = 0
        engine.add(r, handoff)
        while engine.has_work:
            for o in engine.step():
                assert o.error is None, o.error
                out[o.request_id] += o.new_token_ids
    steps = sum(r.stats.num_steps for r in reqs)
    drafted = sum(r.stats.num_draft_tokens for r in reqs)
    accepted = sum(r.stats.num_accepted_tokens for r in reqs)
    emitted = sum(r.stats.num_emitted_tokens for r in reqs)
    stats = {
        "verifying_steps": steps,
        "mean_accepted_length": emitted / steps if steps else 0.0,
        "acceptance": accepted / drafted if drafted else 0.0,
    }
    return [out[r.request_id] for r in reqs], stats


def _write(args: argparse.Namespace, results: dict[str, Any], t0: float, complete: bool) -> None:
    report = {
        "benchmark": "disagg_acceptance",
        "complete": complete,
        "machine": {"cpus": 2, "platform": platform.platform()},
        "model": "SmolLM2-135M-Instruct (embedded), float32, greedy, k = 4 fixed",
        "per_length": args.per_length,
        "max_tokens": args.max_tokens,
        "results": results,
        "wall_s": time.time() - t0,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--per-length", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--drafters", nargs="+", choices=["eagle+lookup", "eagle"])
    ap.add_argument("--out", type=Path, default=RESULTS / "disagg_acceptance.json")
    ap.add_argument("--merge", action="store_true", help="keep --out's rows this run does not redo")
    args = ap.parse_args()
    folder = resolve_checkpoint("embedded")
    tok = Tokenizer(folder)
    target = ModelSpec(str(folder))
    head = ModelSpec(str(embedded_eagle_path()))
    drafts = {
        "eagle+lookup": DraftSpec(DraftKind.EAGLE, head, 4, adaptive=False, lookup_first=True),
        "eagle": DraftSpec(DraftKind.EAGLE, head, 4, adaptive=False),
    }
    drafts = {k: v for k, v in drafts.items() if k in (args.drafters or drafts)}
    prompts = {n: _prompts(tok, n, args.per_length) for n in args.lengths}
    t0 = time.time()
    results: dict[str, Any] = {}
    if args.merge and args.out.exists():
        results = json.loads(args.out.read_text())["results"]
    for name, draft in drafts.items():
        decode = DecodeEngine(
            DecodeEngineConfig("m", target, draft, num_blocks=1536, max_model_len=8192)
        )
        # no prefix cache: the third arm zeroes blocks the cache would hand to later prompts
        prefill = PrefillWorker(
            PrefillWorkerConfig("m", target, draft, num_blocks=1024, enable_prefix_caching=False)
        )
        rows = dict(results.get(name, {}))
        for n, ps in prompts.items():
            colo, a = _serve(decode, None, ps, args.max_tokens)
            dis, b = _serve(decode, prefill, ps, args.max_tokens)
            bare, c = _serve(decode, prefill, ps, args.max_tokens, ship_draft_kv=False)
            rows[str(n)] = {
                "prompt_tokens": [len(p) for p in ps],
                "colocated": a,
                "disaggregated": b,
                "ratio": b["mean_accepted_length"] / a["mean_accepted_length"],
                "outputs_identical": colo == dis,
                "draft_kv_not_shipped": c,
                "ratio_not_shipped": c["mean_accepted_length"] / a["mean_accepted_length"],
                "outputs_identical_not_shipped": colo == bare,
            }
            print(name, n, json.dumps(rows[str(n)]), flush=True)
            _write(args, results | {name: rows}, t0, complete=False)  # a row at a time
        results[name] = rows
        prefill.close()
        decode.close()
    done = all(str(n) in results.get(d, {}) for d in ("eagle+lookup", "eagle") for n in LENGTHS)
    _write(args, results, t0, complete=done)


if __name__ == "__main__":
    main()
