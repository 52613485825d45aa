"""A Qwen3-30B-A3B-shaped mixture of experts (48 layers, hidden 2,048, 32 / 4 heads of 128, 128
experts of 768, top 8, vocabulary 151,936) with random bf16 weights built on the device, its
decode step at batch 1 and 32 over 1k-token contexts as the engine runs it (``BucketedRunner``,
CUDA graphs, experts stacked into grouped matmuls), each over the time to read the bytes the
step touches (the attention weights, the experts the batch routes to, router, head, one
embedding row a token, and the batch's KV) at the bandwidth measured in the same run;
``bench.gpu_check``'s section ``moe_step_bf16`` (``--small``: 2 layers of a tiny shape, CPU).

    python -m bench.gpu_moe [--small]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from runtime.runner import synchronize

QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}
SMALL = QWEN3_30B_A3B | {
    "vocab_size": 4096,
    "hidden_size": 256,
    "moe_intermediate_size": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


def measure(dev: str, small: bool, repeats: int = 10) -> dict[str, Any]:
    from bench.gpu_models import memory_bandwidth, random_model, served_backend
    from models.attention.flex_kernel import FlexKernel
    from models.kv_layout import new_kv_pool
    from models.moe import SparseMoE
    from runtime.bucketed import BucketedRunner
    from runtime.runner import SeqInput

    bandwidth = memory_bandwidth(dev, 2**26 if small else 2**31)
    model = random_model(SMALL if small else QWEN3_30B_A3B, dev)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if dev == "cuda":
        for m in blocks:
            m.stack_experts()
    c = model.cfg
    assert c.moe is not None
    size = model.dtype.itemsize
    expert_bytes = 3 * c.hidden_size * c.moe.expert_intermediate_size * size
    dense = sum(
        p.numel() * size
        for n, p in model.named_parameters()
        if ".experts." not in n and "embed_tokens" not in n
    )
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * size
    nb, context = 64, 1000
    flex = FlexKernel()
    out: dict[str, Any] = {
        "shape": "small" if small else "qwen3-30b-a3b",
        "bandwidth_gb_s": bandwidth / 1e9,
        "grouped_experts": all(m.gate_up is not None for m in blocks),
        "batches": {},
    }
    for batch in (1, 32):
        pool = new_kv_pool(
            batch * nb + 1, c.num_kv_heads, c.num_layers, 16, c.head_dim, model.dtype, dev
        )
        pool.normal_(0.0, 1.0)
        tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
        runner = BucketedRunner(
            model, pool, 16, 64, 1, nb, dev == "cuda", served_backend(model, pool, flex)
        )
        step_in = [SeqInput(t, context, [7 + i], [0]) for i, t in enumerate(tables)]
        for _ in range(3):  # the first call captures
            runner.run(step_in)
        times = []
        for _ in range(repeats):
            synchronize(dev)
            t0 = time.perf_counter()
            runner.run(step_in)
            synchronize(dev)
            times.append(time.perf_counter() - t0)
        # the experts the batch's tokens route to, estimated: every layer's router over the
        # batch's first-layer inputs (a replayed graph runs no Python to observe)
        x = model.embed(torch.tensor([7 + i for i in range(batch)], device=dev))
        hit = sum(
            int(torch.unique(m.route(model.layers[0].input_layernorm(x))[1]).numel())
            for m in blocks
        )
        nbytes = (
            dense + hit * expert_bytes + batch * (c.hidden_size * size + context * kv_per_token)
        )
        ms = 1000 * statistics.median(times)
        out["batches"][batch] = {
            "step_ms": ms,
            "experts_read": hit,
            "bytes_read": nbytes,
            "over_bytes_read": ms / 1000 / (nbytes / bandwidth),
        }
        print(batch, json.dumps(out["batches"][batch]), flush=True)
    out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small", action="store_true", help="a tiny shape (CPU dry run)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps(measure(dev, args.small), indent=2))


if __name__ == "__main__":
    main()
