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
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import openai
import torch

from bench.local_app import local_app
from cluster.config import TandemConfig
from models.weights import resolve_checkpoint

RESULTS = Path(__file__).parent / "results"
SHAPE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # original context 64: positions past it cross every band of llama3's blend
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),  # q, k, v and o biases
    "qwen2": ("qwen2", {"use_sliding_window": False, "tie_word_embeddings": False}),
    "mistral": ("mistral", {"sliding_window": None}),
    # a window of 64 positions: longer prompts and the steps after them reach past it
    "mistral-window": ("mistral", {"sliding_window": 64}),
    "qwen3": ("qwen3", {"use_sliding_window": False, "tie_word_embeddings": False}),
    # YaRN over an original context of 64: the ramp crosses the frequencies; cos/sin scaled
    "qwen3-yarn": (
        "qwen3",
        {
            "use_sliding_window": False,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # fused qkv and gate/up projections; Phi-3-mini's window, scaled to the tiny context
    "phi3": ("phi3", {"tie_word_embeddings": False, "sliding_window": 64, "pad_token_id": 0}),
    # 8 experts, top 2 renormalized; layer 0 dense (mlp_only_layers), layer 1 sparse
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
    ),
    # a sliding layer (32 positions, its own rope base) then a global one (linear rope x8);
    # query_pre_attn_scalar other than head_dim; (1 + w) norms around attention and the MLP
    "gemma3": (
        "gemma3_text",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 32,
            "query_pre_attn_scalar": 24,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    ),
    # Qwen2-MoE: q/k/v biases, experts not renormalized, a gated shared expert every token takes
    "qwen2-moe": (
        "qwen2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "norm_topk_prob": False,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
    ),
    # gpt-oss: attention sinks, a sliding layer then a full one, YaRN, biased experts with the
    # clamped SwiGLU, softmax over the top-k logits
    "gpt-oss": (
        "gpt_oss",
        {
            "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
}


def family_checkpoint(
    folder: Path, family: str, vocab_size: int = 256, tokenizer_from: Path | None = None
) -> Path:
    """A tiny random checkpoint of ``family`` (sharp distributions: weights and biases drawn
    at 0.08), with ``tokenizer_from``'s tokenizer files when given (then ``vocab_size`` must be
    that tokenizer's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    cfg = AutoConfig.for_model(model_type, **{**SHAPE, "vocab_size": vocab_size, **extra})
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, folder / name)
    return folder


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
        from bench.quantized_checkpoints import compressed_checkpoint

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
