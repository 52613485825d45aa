"""GPU checks and numbers, in one run (the device machine; runs on CPU too, for a dry run).

1. Correctness on the device: the paged forward against transformers (fp32 logits, 1e-4 at a
   real scale of values; bf16 greedy agreement), and the decode path — prefill worker → NIXL
   (VRAM registered) → decode engine — greedy-identical to plain decoding, for n-gram and
   draft-model speculation, and EAGLE draft trees (tree masks, accepted-path KV moves).
2. Step cost of a 1B-shaped random model in bf16: decode tokens/s at batch 1..64 and the cost
   of verifying k + 1 tokens relative to one (the curve adaptive speculation uses), up to
   draft-tree sizes (k = 40: a tree 8 wide and 5 deep).
3. KV transfer: NIXL READ of 1, 16 and 256 blocks (VRAM → VRAM, loopback) against a device
   memcpy of the same bytes.

    python -m bench.gpu_check --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.gpu_kv import kv_transfer
from runtime.runner import synchronize


def _tiny(
    folder: Path, seed: int, layers: int, hidden: int, heads: int, kv: int, vocab: int
) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return folder


def check_forward(folder: Path, dev: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from models.attention import kv_pool_shape
    from models.spec import ModelSpec
    from runtime.runner import SeqInput, run_step

    out: dict[str, Any] = {}
    ids = torch.randint(3, 4000, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    for dtype in ("float32", "bfloat16"):
        ours = ModelSpec(str(folder), dtype).load(dev)
        ref: Any = LlamaForCausalLM.from_pretrained(folder, dtype=ours.dtype)
        ref = ref.to(dev).eval()
        c = ours.cfg
        pool = torch.zeros(
            kv_pool_shape(16, c.num_kv_heads, c.num_layers, 16, c.head_dim),
            dtype=ours.dtype,
            device=dev,
        )
        a = run_step(ours, pool, 16, [SeqInput([3, 1, 7, 2, 9], 0, ids[:60], list(range(60)))])
        b = run_step(ours, pool, 16, [SeqInput([3, 1, 7, 2, 9], 60, ids[60:], list(range(10)))])
        mine = torch.cat([a.logits, b.logits])
        with torch.no_grad():
            theirs = ref(torch.tensor([ids], device=dev)).logits[0].float()
        diff = (mine - theirs).abs().max().item()
        agree = (mine.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        out[dtype] = {"max_abs_diff": diff, "argmax_agreement": agree}
        if dtype == "float32":
            assert diff <= 1e-3, f"fp32 logits differ by {diff}"
        else:
            assert agree >= 0.95, f"bf16 argmax agrees on only {agree:.2%}"
    return out


def check_decode_path(target: Path, draft: Path, eagle: Path, dev: str) -> dict[str, Any]:
    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.request import Request
    from models.sampling import SamplingParams
    from models.spec import DraftKind, DraftSpec, ModelSpec
    from prefill.config import PrefillWorkerConfig
    from prefill.worker import PrefillWorker

    t = ModelSpec(str(target))
    drafts = {
        "ngram": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4),
        "draft_model": DraftSpec(
            DraftKind.DRAFT_MODEL, model=ModelSpec(str(draft)), num_speculative_tokens=3
        ),
        "eagle": DraftSpec(DraftKind.EAGLE, model=ModelSpec(str(eagle)), num_speculative_tokens=3),
        "ngram_adaptive": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=6, adaptive=True),
        "eagle_tree": DraftSpec(  # tree masks and accepted-path KV moves on the device
            DraftKind.EAGLE,
            model=ModelSpec(str(eagle)),
            num_speculative_tokens=3,
            adaptive=False,
            lookup_first=True,
            tree_width=3,
        ),
    }
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (30 + 11 * i,), generator=g).tolist() for i in range(4)]
    prompts[0] = prompts[0][:10] * 4  # something n-gram lookup can predict

    def run(engine: DecodeEngine, prefill: PrefillWorker | None) -> list[list[int]]:
        reqs = [
            Request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=24))
            for p in prompts
        ]
        outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        for r in reqs:
            h = prefill.prefill(r) if prefill else None
            if h is not None:
                outs[r.request_id].append(h.first_token)
            engine.add(r, h)
        while engine.has_work:
            for o in engine.step():
                assert o.error is None, o.error
                outs[o.request_id].extend(o.new_token_ids)
        return [outs[r.request_id] for r in reqs]

    plain = run(
        DecodeEngine(DecodeEngineConfig("t", t, DraftSpec(), device=dev, num_blocks=128)), None
    )
    res: dict[str, Any] = {}
    for name, spec in drafts.items():
        engine = DecodeEngine(DecodeEngineConfig("t", t, spec, device=dev, num_blocks=128))
        prefill = PrefillWorker(PrefillWorkerConfig("t", t, spec, device=dev, num_blocks=128))
        assert engine.pool.mem_type == ("VRAM" if dev.startswith("cuda") else "DRAM")
        got = run(engine, prefill)
        assert got == plain, f"{name}: speculative greedy output differs from plain"
        c = engine.transport.counters
        assert c.pulls_done == len(prompts) and c.bytes_pulled > 0
        res[name] = {
            "identical_to_plain": True,
            "pulls": c.pulls_done,
            "bytes_pulled": c.bytes_pulled,
            "mem_type": engine.pool.mem_type,
        }
        prefill.close()
        engine.close()
    return res


def step_costs(folder: Path, dev: str) -> dict[str, Any]:
    from models.attention import kv_pool_shape
    from models.spec import ModelSpec
    from runtime.runner import SeqInput, run_step

    model = ModelSpec(str(folder), "bfloat16").load(dev)
    c = model.cfg
    out: dict[str, Any] = {"decode_ms": {}, "verify_ratio": {}}
    for batch in (1, 8, 16, 32, 64):
        nb = 64  # 1024 tokens of context each
        pool = torch.zeros(
            kv_pool_shape(batch * nb, c.num_kv_heads, c.num_layers, 16, c.head_dim),
            dtype=model.dtype,
            device=dev,
        )
        tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
        for i in range(0, 1000, 500):
            run_step(model, pool, 16, [SeqInput(t, i, list(range(500)), [499]) for t in tables])

        def timed(k: int, pool: torch.Tensor = pool, tables: list[list[int]] = tables) -> float:
            batch_in = [SeqInput(t, 1000, list(range(k + 1)), list(range(k + 1))) for t in tables]
            times = []
            for _ in range(7):
                synchronize(dev)
                t0 = time.perf_counter()
                run_step(model, pool, 16, batch_in)
                synchronize(dev)
                times.append(time.perf_counter() - t0)
            return 1000 * statistics.median(times)

        base = timed(0)
        out["decode_ms"][batch] = base
        if batch in (1, 8, 32):  # chains up to k = 8, then draft-tree sizes (width x k)
            ks = (*range(0, 9), 16, 20, 30, 40)
            out["verify_ratio"][batch] = {k: timed(k) / base for k in ks}
    return out


def engine_throughput(folder: Path, dev: str) -> dict[str, Any]:
    """Generated tokens/s of the decode engine (prompts computed in-engine, greedy, no drafts)
    at several batch sizes, with ragged steps and with bucketed ones (CUDA graphs on a GPU,
    ``runtime.bucketed``), against transformers' ``generate`` at batch 1 on the same model;
    the two engines' greedy tokens must agree."""
    from transformers import LlamaForCausalLM

    from decode.config import DecodeEngineConfig
    from decode.engine import DecodeEngine
    from models.request import Request
    from models.sampling import SamplingParams
    from models.spec import DraftSpec, ModelSpec

    new, plen = 128, 128
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(5)
    out: dict[str, Any] = {"prompt_tokens": plen, "new_tokens": new}
    prompts = {
        batch: [torch.randint(3, vocab, (plen,), generator=g).tolist() for _ in range(batch)]
        for batch in (1, 16, 64)
    }
    tokens: dict[str, list[list[int]]] = {}
    for shapes in ("ragged", "bucketed"):
        engine = DecodeEngine(
            DecodeEngineConfig(
                "big",
                ModelSpec(str(folder), "bfloat16"),
                DraftSpec(),
                device=dev,
                num_blocks=2048,
                step_shapes=shapes,
            )
        )
        speeds: dict[int, float] = {}
        for batch in (1, 1, 16, 64):  # the first batch-1 run warms up (and captures)
            reqs = [
                Request(uuid.uuid4().hex, p, SamplingParams(temperature=0.0, max_tokens=new))
                for p in prompts[batch]
            ]
            synchronize(dev)
            t0 = time.perf_counter()
            for r in reqs:
                engine.add(r, None)
            n = 0
            while engine.has_work:
                n += sum(len(o.new_token_ids) for o in engine.step())
            synchronize(dev)
            speeds[batch] = n / (time.perf_counter() - t0)
            tokens.setdefault(shapes, []).extend(r.output_token_ids for r in reqs)
        out[f"engine_tok_s_{shapes}"] = speeds
        engine.close()
    out["engine_tok_s"] = out["engine_tok_s_bucketed"]
    out["bucketed_greedy_identical"] = tokens["ragged"] == tokens["bucketed"]
    ref: Any = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ref = ref.to(dev).eval()
    ids = torch.randint(3, vocab, (1, plen), generator=g).to(dev)
    for _ in range(2):  # warm-up, then timed
        synchronize(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = ref.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        synchronize(dev)
        hf = (gen.shape[1] - plen) / (time.perf_counter() - t0)
    out["transformers_tok_s_batch1"] = hf
    out["engine_over_transformers_batch1"] = out["engine_tok_s"][1] / hf
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
    ap.add_argument("--skip-costs", action="store_true")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    tmp = Path(tempfile.mkdtemp())
    target = _tiny(tmp / "t", 1, 2, 128, 4, 2, 4096)
    draft = _tiny(tmp / "d", 2, 1, 64, 2, 1, 4096)
    from models.eagle import save_random_eagle

    eagle = save_random_eagle(target, tmp / "e")
    for name, fn in (
        ("forward", lambda: check_forward(target, dev)),
        ("decode_path", lambda: check_decode_path(target, draft, eagle, dev)),
        ("kv_transfer", lambda: kv_transfer(dev)),
    ):
        t0 = time.perf_counter()
        report[name] = fn()
        print(name, json.dumps(report[name]), f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if not args.skip_costs:
        big = _tiny(tmp / "big", 3, 16, 2048, 32, 8, 32000)
        report["engine_1b_bf16"] = engine_throughput(big, dev)
        print("engine", json.dumps(report["engine_1b_bf16"]), flush=True)
        report["step_costs_1b_bf16"] = step_costs(big, dev)
        print("step_costs", json.dumps(report["step_costs_1b_bf16"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
