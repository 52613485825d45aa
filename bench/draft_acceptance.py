"""Re-measure a shipped EAGLE draft through the real decode path, on held-out ShareGPT prompts.

Prompts are the first user turns of conversations on the held-out side of the split the draft
was trained with (``held_out_per_mille`` from its ``card.json``; training never read them), in
file order. Each prompt runs through ``DecodeEngine`` with the head drafting a fixed ``k``
tokens per step (adaptive off), once greedy and once at temperature 0.7 (seeded). With
``--ngram`` the same prompts also run under n-gram prompt lookup (same k) for comparison, with
``--lookup-first`` under the head behind lookup (``draft.lookup_first``: lookup where it finds
a match, the head elsewhere), and ``--no-eagle`` leaves out the head alone. ``--tree-width W``
adds each head configuration drafting trees ``W`` wide for greedy requests
(``draft.tree_width``; measured at temperature 0 only, since sampled requests draft chains).
Reported per drafter and temperature: acceptance rate (accepted / drafted) and mean tokens per
target forward (tokens emitted by the verification steps over those steps: accepted plus the
recovered or bonus token). Prompts run in chunks and the JSON is rewritten after each, so a run
stopped early still reports how many prompts it covered.

``--speedup N`` adds batch-1 decode speed through the engine on the first N prompts, greedy,
with adaptive speculation as served (``draft.adaptive``): the drafters above and n-gram lookup
against speculation off (alternated per prompt, medians), checking the outputs are identical.

    .venv/bin/python -m bench.draft_acceptance [--draft models/drafts/smollm2-135m-eagle]
        [--prompts 200] [--max-tokens 64] [--k 4] [--ngram] [--lookup-first] [--no-eagle]
        [--tree-width 4 [--trees-only]] [--speedup 8]

Writes bench/results/draft_acceptance.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.engine_run import decode_after_first
from bench.sharegpt import chat_prompts
from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from distill.sharegpt import held_out, iter_conversations
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
TEMPERATURES = (0.0, 0.7)


def held_out_prompts(per_mille: int, n: int, max_chars: int) -> list[str]:
    out: list[str] = []
    for conv in iter_conversations():
        p = conv.first_prompt
        if held_out(conv, per_mille) and p is not None and 16 <= len(p) <= max_chars:
            out.append(p)
            if len(out) >= n:
                break
    return out


def _engine(target: ModelSpec, draft: DraftSpec, batch: int) -> DecodeEngine:
    cfg = DecodeEngineConfig("m", target, draft, num_blocks=4096, max_batch_size=batch)
    return DecodeEngine(cfg)


def _run(engine: DecodeEngine, reqs: list[Request]) -> float:
    """Decode ``reqs`` together; returns decode seconds after every first token."""
    return decode_after_first(engine, reqs)


def _request(prompt: list[int], temperature: float, seed: int, max_tokens: int) -> Request:
    params = SamplingParams(
        temperature=temperature, max_tokens=max_tokens, seed=seed, stop_token_ids=(2,)
    )
    return Request(uuid.uuid4().hex, prompt, params)


def _totals(reqs: list[Request]) -> dict[str, int]:
    return {
        "steps": sum(r.stats.num_steps for r in reqs),
        "drafted": sum(r.stats.num_draft_tokens for r in reqs),
        "accepted": sum(r.stats.num_accepted_tokens for r in reqs),
        "emitted": sum(r.stats.num_emitted_tokens for r in reqs),
        "decoded": sum(len(r.output_token_ids) - 1 for r in reqs),
    }


def _summary(t: dict[str, int]) -> dict[str, Any]:
    return {
        **t,
        "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
        "tokens_per_target_forward": t["emitted"] / t["steps"] if t["steps"] else None,
    }


def _temperatures(name: str) -> tuple[float, ...]:
    """A tree configuration samples by chains, as its chain twin: greedy alone tells it apart."""
    return (0.0,) if "-tree" in name else TEMPERATURES


def acceptance(
    engines: dict[str, DecodeEngine],
    prompts: list[list[int]],
    args: argparse.Namespace,
    report: dict[str, Any],
) -> None:
    keys = ("steps", "drafted", "accepted", "emitted", "decoded")
    temps = {name: _temperatures(name) for name in engines}
    totals = {name: {t: dict.fromkeys(keys, 0) for t in temps[name]} for name in engines}
    identical = True  # every drafter's greedy output the same (each is the target's)
    for start in range(0, len(prompts), args.chunk):
        chunk = prompts[start : start + args.chunk]
        greedy: dict[str, list[list[int]]] = {}
        for name, engine in engines.items():
            for temp in temps[name]:
                reqs = [_request(p, temp, start + i, args.max_tokens) for i, p in enumerate(chunk)]
                _run(engine, reqs)
                for key, v in _totals(reqs).items():
                    totals[name][temp][key] += v
                if temp == 0.0:
                    greedy[name] = [r.output_token_ids for r in reqs]
        identical &= all(out == next(iter(greedy.values())) for out in greedy.values())
        report["acceptance"] = {
            "prompts": start + len(chunk),
            "greedy_outputs_identical_across_drafters": identical,
            **{
                name: {f"temperature_{t}": _summary(totals[name][t]) for t in temps[name]}
                for name in engines
            },
        }
        _write(report)
        print(json.dumps(report["acceptance"]), flush=True)


def speedup(
    target: ModelSpec, drafts: dict[str, DraftSpec], prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    engines = {name: _engine(target, spec, 1) for name, spec in drafts.items()}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    identical = dict.fromkeys(engines, True)
    for i, p in enumerate(prompts):
        outs: dict[str, list[int]] = {}
        for name, engine in engines.items():  # alternate per prompt: this machine is noisy
            r = _request(p, 0.0, i, max_tokens)
            dt = _run(engine, [r])
            outs[name] = r.output_token_ids
            rates[name].append((len(r.output_token_ids) - 1) / dt)
        for name in engines:
            identical[name] &= outs[name] == outs["off"]
    med = {name: statistics.median(v) for name, v in rates.items()}
    return {
        "prompts": len(prompts),
        "decode_tok_s_median": med,
        "speedup_over_off": {name: med[name] / med["off"] for name in engines if name != "off"},
        "greedy_identical_to_off": {name: v for name, v in identical.items() if name != "off"},
    }


def _write(report: dict[str, Any]) -> None:
    path = Path(report["out"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def _drafts(head: ModelSpec, args: argparse.Namespace, adaptive: bool) -> dict[str, DraftSpec]:
    """The drafters measured: the head alone, n-gram lookup, the head behind lookup."""
    out = {}
    if not args.no_eagle:
        out["eagle"] = DraftSpec(DraftKind.EAGLE, head, args.k, adaptive=adaptive)
    if args.ngram:
        out["ngram"] = DraftSpec(DraftKind.NGRAM, None, args.k, adaptive=adaptive)
    if args.lookup_first:
        out["eagle+lookup"] = DraftSpec(
            DraftKind.EAGLE, head, args.k, adaptive=adaptive, lookup_first=True
        )
    if args.tree_width > 1:  # greedy requests draft trees; sampled ones chains, as "eagle"
        for name in [n for n in out if n.startswith("eagle")]:
            out[f"{name}-tree{args.tree_width}"] = DraftSpec(
                DraftKind.EAGLE,
                head,
                args.k,
                adaptive=adaptive,
                lookup_first=out[name].lookup_first,
                tree_width=args.tree_width,
            )
        if args.trees_only:
            out = {name: spec for name, spec in out.items() if spec.tree_width > 1}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--draft", type=Path, default=Path("models/drafts/smollm2-135m-eagle"))
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--max-chars", type=int, default=800, help="longest prompt, in characters")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (fixed)")
    ap.add_argument("--chunk", type=int, default=25, help="prompts decoded together")
    ap.add_argument("--ngram", action="store_true", help="also measure n-gram lookup")
    ap.add_argument(
        "--lookup-first", action="store_true", help="also measure the head behind lookup"
    )
    ap.add_argument("--no-eagle", action="store_true", help="skip the head alone")
    ap.add_argument(
        "--tree-width",
        type=int,
        default=1,
        help="also measure each head configuration drafting trees this wide (greedy only)",
    )
    ap.add_argument("--trees-only", action="store_true", help="with --tree-width: trees alone")
    ap.add_argument("--speedup", type=int, default=0, help="prompts for the batch-1 speed part")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "draft_acceptance.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    card = json.loads((args.draft / "card.json").read_text())
    folder = resolve_checkpoint(card["target"]["source"])
    tok = Tokenizer(folder)
    texts = held_out_prompts(card["data"]["held_out_per_mille"], args.prompts, args.max_chars)
    prompts = chat_prompts(tok, texts)
    target = ModelSpec(str(folder))
    head = ModelSpec(str(args.draft))
    fixed = _drafts(head, args, adaptive=False)
    report: dict[str, Any] = {
        "draft": str(args.draft),
        "target": str(folder.name),
        "k": args.k,
        "max_tokens": args.max_tokens,
        "prompt_source": f"held-out ShareGPT first user turns (per mille "
        f"{card['data']['held_out_per_mille']}), 16..{args.max_chars} chars, file order",
        "threads": args.threads,
        "out": str(args.out),
    }
    if args.speedup:
        served = {  # adaptive k, as `tandem serve` runs them; n-gram always, for reference
            "off": DraftSpec(),
            **_drafts(head, args, adaptive=True),
            "ngram": DraftSpec(DraftKind.NGRAM, None, args.k),
        }
        report["batch1_speedup"] = speedup(target, served, prompts[: args.speedup], args.max_tokens)
        _write(report)
        print(json.dumps(report["batch1_speedup"]), flush=True)
    if len(prompts) > args.speedup:  # --prompts N --speedup N: the speed part only
        engines = {name: _engine(target, spec, args.chunk) for name, spec in fixed.items()}
        acceptance(engines, prompts, args, report)


if __name__ == "__main__":
    main()
