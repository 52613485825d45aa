"""Every supported checkpoint family served end to end, against transformers, in one run.

For each family (``FAMILIES``: Llama 3.x rope scaling, linear scaling, Llama attention biases,
Qwen2, Qwen3, Mistral with and without its sliding window, Phi-3, Gemma 3, and the mixtures of
experts Qwen3-MoE and Mixtral; then pre-quantized compressed-tensors checkpoints of the Qwen3
one, ``--formats``) a tiny random checkpoint with the
embedded model's tokenizer is served the way ``tandem serve --model DIR`` serves it (a local
colocated app, n-gram drafting, through the OpenAI API and the ``openai`` client), and each
prompt's greedy completion is compared with transformers' ``generate`` on the same checkpoint:
the same text, token for token. The prompts (token ids) are long enough to reach past the
Mistral window.

    .venv/bin/python -m bench.families [--prompts 3] [--max-tokens 24]
        [--out bench/results/families.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import torch

from bench.family_checkpoints import FAMILIES, family_checkpoint
from bench.local_app import local_app
from bench.quantized_checkpoints import compressed_checkpoint
from cluster.config import TandemConfig
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"


def _config(folder: Path, port: int) -> TandemConfig:
    return TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(folder), "name": "family"},
            "draft": {"kind": "ngram", "num_speculative_tokens": 3},
            "decode": {"num_blocks": 256, "num_threads": 2},
            "http": {"port": port},
            "grpc": {"enabled": False},
        }
    )


def served(
    family: str, folder: Path, prompts: list[list[int]], max_tokens: int, port: int
) -> dict[str, Any]:
    """Serve the checkpoint, complete each prompt greedily, compare with transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    want = []
    for ids in prompts:
        with torch.no_grad():
            out = ref.generate(  # no end-of-sequence stop, as ignore_eos asks of tandem
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
            )
        want.append(tok.decode(out[0, len(ids) :].tolist(), skip_special_tokens=True))
    t0 = time.perf_counter()
    with local_app(_config(folder, port), num_cpus=2) as base:
        started = time.perf_counter() - t0
        client = openai.OpenAI(base_url=base, api_key="x", timeout=300)
        got = [
            client.completions.create(
                model="family",
                prompt=ids,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for ids in prompts
        ]
    same = sum(g == w for g, w in zip(got, want, strict=True))
    row = {"family": family, "identical": same, "prompts": len(prompts), "start_s": started}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--port", type=int, default=8141)
    ap.add_argument("--families", nargs="*", default=sorted(FAMILIES))
    ap.add_argument(
        "--formats",
        nargs="*",
        default=["w8a16", "w4a16", "fp8-dynamic", "fp8-static", "w8a8-int8"],
        help="compressed-tensors schemes (bench.quantized_checkpoints) of the qwen3 checkpoint",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "families.json")
    args = ap.parse_args()
    embedded = resolve_checkpoint("embedded")
    vocab = json.loads((embedded / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(3, vocab, (40 + 50 * i,), generator=g).tolist() for i in range(args.prompts)
    ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            folder = family_checkpoint(Path(tmp) / family, family, vocab, embedded)
            rows.append(served(family, folder, prompts, args.max_tokens, args.port))
        for scheme in args.formats:
            folder = compressed_checkpoint(Path(tmp) / scheme, "qwen3", scheme, vocab, embedded)
            rows.append(served(f"qwen3+{scheme}", folder, prompts, args.max_tokens, args.port))
    report = {
        "benchmark": "families",
        "machine": {"cpus": 2, "platform": platform.platform()},
        "max_tokens": args.max_tokens,
        "prompt_tokens": [len(p) for p in prompts],
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
