"""GPU checks and numbers, in one run (the device machine; runs on CPU too, for a dry run).

Sections, in the order they run, each in a process of its own (each is timed, a failure or a
timeout is recorded and the run goes on, the JSON is rewritten after every section, and
sections past ``--budget`` seconds are skipped):

1. ``forward``: the paged forward against transformers (fp32 logits, 1e-3 at a real scale of
   values; bf16 greedy agreement).
2. ``graph_steps_1b_bf16``: the decode step of a 1B-shaped random model in bf16 as the engine
   runs it on a GPU (``runtime.bucketed``: persistent inputs, one CUDA graph per bucket) against
   the ragged eager step, at batch 1..64 over 1,024 tokens of context, and k = 4 verifications;
   then the same bucketed step with int8 and fp8 weights (``graph_steps_1b_int8/fp8``).
3. ``engine_1b_bf16``: generated tokens/s of the decode engine, ragged and bucketed, against
   transformers' ``generate`` at batch 1 (greedy tokens of the two shapes must agree).
4. ``decode_path``: prefill worker -> NIXL (VRAM registered) -> decode engine, greedy-identical
   to plain decoding for n-gram, draft-model and EAGLE speculation and EAGLE draft trees.
5. ``kv_transfer``: ``bench.gpu_kv`` in a subprocess per setting of ``KV_SETTINGS`` (two
   processes as served, with the source polling, busy or on NIXL's progress thread; one
   process; UCX's own ``cuda_ipc`` default), each with ``UCX_PROTO_INFO=y``; UCX's report
   goes to ``--log-dir``.
6. ``step_costs_1b_bf16``: the ragged step's cost of verifying k + 1 tokens relative to one (the
   curve adaptive speculation uses), up to draft-tree sizes.
7. ``steps_8b_bf16``: a Llama-3.1-8B-shaped bf16 model (32 layers, hidden 4,096, 32 / 8 heads of
   128, vocabulary 128,256, llama3 rope) with random weights built on the device (nothing
   written to disk), over a pool of 4,096 blocks whose tables lie above block 2,048 (where
   int32 offsets into a block-major pool would overflow): the bucketed step reading in place
   against the same step gathering, token by token, at batch 1 / 8 / 32 / 64 with 1k-token
   contexts and k = 4, each step over the time to read its bytes once at the bandwidth
   measured in the same run (``--small``: 2 layers of a small shape, 160 blocks).
8. ``warm_up_8b_bf16``: ``bench.gpu_warm_up``, every bucket of a 64-sequence, 8k-token, k = 4
   replica at the 8B shape captured at start-up, timed, and what a mixed run then compiles or
   captures (0 is the goal).
9. ``attention_8b_bf16``: ``bench.gpu_attention``, one layer's attention at the 8B KV shape
   for every kind of step (decodes, verifications, a width-4 tree, prompt chunks, a sliding
   window), flex in place against gathering: what the flex backend's gathering rule rests on.
10. ``moe_step_bf16``: ``bench.gpu_moe``, a Qwen3-30B-A3B-shaped MoE's decode step at batch 1
    and 32 (grouped expert matmuls, CUDA graphs) over the bytes it reads.
11. ``host_time_1b_bf16``: ``bench.host_time`` on the 1B-shaped model, the host's time per
    decode step outside the target forward at batch 1, 32 and 64, plain and n-gram.
12. ``syncs``: ``bench.gpu_syncs``, the device-to-host synchronisations per decode step for
    each drafter, and where they are.

    python -m bench.gpu_check --out results.json --log-dir logs/
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.gpu_models import LLAMA_8B, SMALL_8B, memory_bandwidth, random_model, served_backend
from runtime.runner import synchronize

if TYPE_CHECKING:
    from models.attention.flex_kernel import FlexKernel


def _tiny(
    folder: Path,
    seed: int,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    vocab: int,
    dev: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Path:
    """A random Llama checkpoint, initialised on ``dev`` and saved in ``dtype``."""
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
    with torch.device(dev):
        model: Any = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.to(dtype).save_pretrained(folder)
    return folder


def check_forward(folder: Path, dev: str) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from models.kv_layout import new_kv_pool
    from models.spec import ModelSpec
    from runtime.runner import LocalRunner, SeqInput

    out: dict[str, Any] = {}
    ids = torch.randint(3, 4000, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    for dtype in ("float32", "bfloat16"):
        ours = ModelSpec(str(folder), dtype).load(dev)
        ref: Any = LlamaForCausalLM.from_pretrained(folder, dtype=ours.dtype)
        ref = ref.to(dev).eval()
        c = ours.cfg
        pool = new_kv_pool(16, c.num_kv_heads, c.num_layers, 16, c.head_dim, ours.dtype, dev)
        runner = LocalRunner(ours, pool, 16)  # its modules, the attention chosen for the device
        a = runner.run([SeqInput([3, 1, 7, 2, 9], 0, ids[:60], list(range(60)))])
        b = runner.run([SeqInput([3, 1, 7, 2, 9], 60, ids[60:], list(range(10)))])
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


def _cached_pool(
    model: Any, batch: int, nb: int, dev: str, flex: FlexKernel
) -> tuple[torch.Tensor, list[list[int]]]:
    """A pool of ``batch`` sequences of ``nb`` blocks each, 1,000 tokens of each already cached
    (two 500-token prompt chunks), and their block tables."""
    from models.kv_layout import new_kv_pool
    from runtime.runner import SeqInput, run_step

    c = model.cfg
    pool = new_kv_pool(batch * nb, c.num_kv_heads, c.num_layers, 16, c.head_dim, model.dtype, dev)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    backend = served_backend(model, pool, flex)
    for i in range(0, 1000, 500):
        run_step(backend, pool, [SeqInput(t, i, list(range(500)), [499]) for t in tables])
    return pool, tables


def step_costs(folder: Path, dev: str) -> dict[str, Any]:
    """The ragged step's cost of verifying k + 1 tokens over one token, after 1,000 cached."""
    from models.attention.flex_kernel import FlexKernel
    from models.spec import ModelSpec
    from runtime.runner import LocalRunner, SeqInput

    model = ModelSpec(str(folder), "bfloat16").load(dev)
    flex = FlexKernel()
    out: dict[str, Any] = {"decode_ms": {}, "verify_ratio": {}}
    for batch in (1, 8, 32):
        nb = 66  # 1,056 tokens a sequence: 1,000 cached and up to 41 verified
        pool, tables = _cached_pool(model, batch, nb, dev, flex)
        runner = LocalRunner(model, pool, 16, served_backend(model, pool, flex))

        def timed(k: int, runner: LocalRunner = runner, tables: list[list[int]] = tables) -> float:
            batch_in = [SeqInput(t, 1000, list(range(k + 1)), list(range(k + 1))) for t in tables]
            times = []
            for _ in range(7):
                synchronize(dev)
                t0 = time.perf_counter()
                runner.run(batch_in)
                synchronize(dev)
                times.append(time.perf_counter() - t0)
            return 1000 * statistics.median(times)

        base = timed(0)
        out["decode_ms"][batch] = base
        ks = (*range(0, 9), 16, 20, 30, 40)  # chains up to k = 8, then draft-tree sizes
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
                warm_up="off",  # its untimed first runs capture what each batch size meets
            )
        )
        speeds: dict[int, float] = {}
        # each batch size runs twice, the first untimed: it captures the buckets that size
        # meets (and compiles their kernels), which a serving replica pays once
        for batch, timed in (
            (1, False),
            (1, True),
            (16, False),
            (16, True),
            (64, False),
            (64, True),
        ):
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
            if timed:
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


def graph_steps(
    folder: Path,
    dev: str,
    quantization: str = "none",
    batches: tuple[int, ...] = (1, 8, 32, 64),
    ks: tuple[int, ...] = (0, 4),
    compare: bool = True,
) -> dict[str, Any]:
    """One decode step (and k = 4 verifications) per sequence after 1,000 cached tokens, as
    ``runtime.bucketed`` runs it (a CUDA graph per bucket on a GPU, attention reading the pool
    in place through ``flex_attention``; the step's host work, input copy and logits included);
    with ``compare``, against the same buckets gathering the context (the reference backend,
    ``models.attention.reference``) and the ragged eager step (``LocalRunner``) on the same
    pool. Median of 15 after warm-up; greedy agreement with the ragged step reported."""
    from models.attention.flex import FlexBackend
    from models.attention.flex_kernel import FlexKernel
    from models.attention.reference import ReferenceBackend
    from models.backend import TorchBackend
    from models.spec import ModelSpec
    from runtime.backends import exact_attention, model_attention_spec
    from runtime.bucketed import BucketedRunner
    from runtime.runner import LocalRunner, SeqInput

    model = ModelSpec(str(folder), "bfloat16", quantization).load(dev)
    flex = FlexKernel()  # the model's one flex kernel, for every runner and pool below
    nb = 64  # blocks of 16: 1,024 tokens of context per sequence
    out: dict[str, Any] = {"context": 1000, "quantization": quantization, "batches": {}}
    graphs = dev == "cuda"
    bucketed: BucketedRunner | None = None
    for batch in batches:
        pool, tables = _cached_pool(model, batch, nb, dev, flex)
        bucketed = BucketedRunner(
            model, pool, 16, 64, 8, nb, graphs, served_backend(model, pool, flex)
        )
        steps: dict[str, Callable[[list[SeqInput]], Any]] = {"bucketed": bucketed.run}
        if compare:
            spec = model_attention_spec(model, pool, 16)
            gathering = TorchBackend(model, ReferenceBackend(spec, exact_attention(model)))
            gather = BucketedRunner(model, pool, 16, 64, 8, nb, graphs, gathering)
            steps["bucketed_gather"] = gather.run
            steps["ragged"] = LocalRunner(model, pool, 16, served_backend(model, pool, flex)).run
        row: dict[str, Any] = {}
        for k in ks:
            batch_in = [SeqInput(t, 1000, list(range(k + 1)), list(range(k + 1))) for t in tables]
            got: dict[str, Any] = {}
            argmax: dict[str, torch.Tensor] = {}
            for name, step in steps.items():
                for _ in range(3):  # the first bucketed call compiles and captures
                    res = step(batch_in)
                times = []
                for _ in range(15):
                    synchronize(dev)
                    t0 = time.perf_counter()
                    res = step(batch_in)
                    synchronize(dev)
                    times.append(time.perf_counter() - t0)
                got[f"{name}_ms"] = 1000 * statistics.median(times)
                argmax[name] = res.logits.argmax(-1)
            if compare:
                got["agreement_with_ragged"] = {
                    n: (a == argmax["ragged"]).float().mean().item() for n, a in argmax.items()
                }
            row[f"k{k}"] = got
        out["batches"][batch] = row
    # the flex kernel of the model's bucketed runner (on a GPU; elsewhere none ran)
    attention = None if bucketed is None else bucketed.backend.attention
    kernel = attention.kernel if isinstance(attention, FlexBackend) else None
    out["flex_failed"] = None if kernel is None else kernel.failed
    out["flex_fallbacks"] = 0 if kernel is None else kernel.fallbacks
    out["flex_failed_shapes"] = [] if kernel is None else list(kernel.failed_shapes.values())
    out["flex_too_large"] = 0 if kernel is None else kernel.too_large
    b = out["batches"]
    if 1 in b and 64 in b:  # the goal: at most 2
        out["batch64_over_batch1"] = b[64]["k0"]["bucketed_ms"] / b[1]["k0"]["bucketed_ms"]
    return out


HIGH_BLOCK = 2048  # tables above this block of a block-major 8B pool pass 2**31 elements


def steps_8b(dev: str, small: bool) -> dict[str, Any]:
    """Section 7 (see the module's docstring)."""
    from models.attention.flex import FlexBackend
    from models.attention.flex_kernel import FlexKernel
    from models.attention.reference import ReferenceBackend
    from models.backend import TorchBackend
    from models.kv_layout import new_kv_pool
    from runtime.backends import exact_attention, model_attention_spec
    from runtime.bucketed import BucketedRunner
    from runtime.runner import SeqInput

    bandwidth = memory_bandwidth(dev, 2**26 if small else 2**31)
    model = random_model(SMALL_8B if small else LLAMA_8B, dev)
    c = model.cfg
    # the LM head is read whole each step, the embedding table one row a token
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    num_blocks, nb, context = (160, 8, 100) if small else (4096, 64, 1000)
    batches = (1, 8) if small else (1, 8, 32, 64)
    pool = new_kv_pool(num_blocks, c.num_kv_heads, c.num_layers, 16, c.head_dim, model.dtype, dev)
    pool.normal_(0.0, 1.0)  # random KV: the backends are compared on the same values
    # the int32 guard lifted: agreement with gathering says whether a pool this large needs it
    flex = FlexKernel(max_view_elements=None)
    spec = model_attention_spec(model, pool, 16)
    inplace = BucketedRunner(
        model, pool, 16, 64, 8, nb, dev == "cuda", served_backend(model, pool, flex)
    )
    gathering = TorchBackend(model, ReferenceBackend(spec, exact_attention(model)))
    gather = BucketedRunner(model, pool, 16, 64, 8, nb, dev == "cuda", gathering)
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * pool.element_size()
    out: dict[str, Any] = {
        "shape": "small" if small else "llama-3.1-8b",
        "bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_read": weights,
        "pool_blocks": num_blocks,
        "pool_gb": pool.numel() * pool.element_size() / 1e9,
        "lowest_block_read": num_blocks - max(batches) * nb,
        "high_block": HIGH_BLOCK,
        "context": context,
        "batches": {},
    }
    for batch in batches:
        # block tables from the top of the pool down: batch 1's reads all lie past HIGH_BLOCK
        tables = [list(range(num_blocks - (i + 1) * nb, num_blocks - i * nb)) for i in range(batch)]
        row: dict[str, Any] = {}
        for k in (0, 4):
            step_in = [SeqInput(t, context, list(range(k + 1)), list(range(k + 1))) for t in tables]
            got: dict[str, Any] = {}
            tokens: dict[str, torch.Tensor] = {}
            for name, runner in (("inplace", inplace), ("gather", gather)):
                for _ in range(3):  # the first call compiles and captures
                    res = runner.run(step_in)
                times = []
                for _ in range(10):
                    synchronize(dev)
                    t0 = time.perf_counter()
                    res = runner.run(step_in)
                    synchronize(dev)
                    times.append(time.perf_counter() - t0)
                got[f"{name}_ms"] = 1000 * statistics.median(times)
                tokens[name] = res.logits.argmax(-1)
            agree = (tokens["inplace"] == tokens["gather"]).float()
            got["inplace_gather_agreement"] = agree.mean().item()
            got["first_disagreement"] = int(agree.argmin().item()) if agree.min() < 1 else None
            nbytes = weights + batch * (context + k + 1) * kv_per_token
            got["over_bytes_read"] = got["inplace_ms"] / 1000 / (nbytes / bandwidth)
            row[f"k{k}"] = got
        row["k4_over_k0"] = row["k4"]["inplace_ms"] / row["k0"]["inplace_ms"]
        out["batches"][batch] = row
    attention = inplace.backend.attention
    kernel = attention.kernel if isinstance(attention, FlexBackend) else None
    out["attention"] = type(attention).__name__
    out["flex_failed"] = None if kernel is None else kernel.failed
    out["flex_fallbacks"] = 0 if kernel is None else kernel.fallbacks
    out["flex_failed_shapes"] = [] if kernel is None else list(kernel.failed_shapes.values())
    out["flex_too_large"] = 0 if kernel is None else kernel.too_large
    out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None
    return out


KV_SETTINGS: dict[str, tuple[list[str], dict[str, str]]] = {
    # as served: NixlTransport sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y on a VRAM pool
    "two_process": (["--mode", "two_process"], {}),
    # whether a pull's fixed cost comes from how often the source lets UCX progress
    "two_process_busy_source": (["--mode", "two_process", "--source-progress", "busy"], {}),
    "two_process_progress_thread": (["--mode", "two_process", "--source-progress", "thread"], {}),
    "loopback": (["--mode", "loopback"], {}),
    # UCX's own default, which turned cuda_ipc gets off here (no NVLink)
    "two_process_get_zcopy_auto": (
        ["--mode", "two_process"],
        {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"},
    ),
}


def _ucx_reads(text: str) -> list[str]:
    """The protocol tables ``UCX_PROTO_INFO=y`` printed for remote reads (``ucp_get*``: what a
    NIXL READ becomes), and UCX's warnings and errors, without the timestamp prefixes."""
    lines = [ln.split("]", 2)[-1].strip() for ln in text.splitlines()]
    keep: list[str] = []
    for i, ln in enumerate(lines):
        if "ucp_get" in ln:
            keep.extend(lines[i : i + 8])
        elif " WARN " in ln or " ERROR " in ln:
            keep.append(ln)
    return keep[:80]


def kv_settings(log_dir: Path, blocks: int) -> dict[str, Any]:
    """``bench.gpu_kv`` under each of ``KV_SETTINGS``, in a subprocess each (a transport that
    crashes or hangs costs its own setting only), with UCX's protocol report in a log each."""
    out: dict[str, Any] = {}
    for name, (flags, env) in KV_SETTINGS.items():
        res = log_dir / f"kv_{name}.json"
        log = log_dir / f"ucx_{name}.log"
        full = {**os.environ, "UCX_PROTO_INFO": "y", **env}
        cmd = [sys.executable, "-m", "bench.gpu_kv", *flags, "--out", str(res)]
        cmd += ["--blocks", str(blocks)]
        t0 = time.perf_counter()
        with log.open("w") as f:
            try:
                rc = subprocess.run(
                    cmd, env=full, stdout=f, stderr=subprocess.STDOUT, timeout=150, check=False
                )
                code: int | str = rc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout after 150 s"
        text = log.read_text(errors="replace")
        out[name] = {
            "ucx_env": env,
            "exit": code,
            "seconds": time.perf_counter() - t0,
            "result": json.loads(res.read_text()) if res.exists() else None,
            "ucx_reads": _ucx_reads(text),
            "log_tail": text.splitlines()[-8:] if code != 0 else [],
        }
        res.unlink(missing_ok=True)
        print("kv", name, json.dumps(out[name]["result"]), code, flush=True)
    return out


SECTIONS = (
    "steps_8b_bf16",  # issue 53's shape first
    "warm_up_8b_bf16",
    "attention_8b_bf16",
    "moe_step_bf16",
    "forward",
    "graph_steps_1b_bf16",
    "engine_1b_bf16",
    "decode_path",
    "kv_transfer",
    "graph_steps_1b_int8",
    "graph_steps_1b_fp8",
    "step_costs_1b_bf16",
    "host_time_1b_bf16",
    "syncs",
)
SECTION_TIMEOUT_S = 200.0


def make_models(folder: Path, dev: str, small: bool) -> None:
    """The random checkpoints every section reads: a tiny target, draft model and EAGLE head,
    and the 1B-shaped bf16 model (2 layers of the tiny shape with ``small``)."""
    from models.eagle import save_random_eagle

    target = _tiny(folder / "t", 1, 2, 128, 4, 2, 4096)
    _tiny(folder / "d", 2, 1, 64, 2, 1, 4096)
    save_random_eagle(target, folder / "e")
    shape = (2, 128, 4, 2, 4096) if small else (16, 2048, 32, 8, 32000)
    _tiny(folder / "big", 3, *shape, dev=dev, dtype=torch.bfloat16)


def run_section(name: str, models: Path, dev: str, small: bool, log_dir: Path) -> Any:
    big = models / "big"
    batches = (1, 8) if small else (1, 64, 8, 32)  # the goal's two sizes first
    if name == "forward":
        return check_forward(models / "t", dev)
    if name == "graph_steps_1b_bf16":
        return graph_steps(big, dev, "none", batches)
    if name == "engine_1b_bf16":
        return engine_throughput(big, dev)
    if name == "decode_path":
        return check_decode_path(models / "t", models / "d", models / "e", dev)
    if name == "kv_transfer":
        return kv_settings(log_dir, 300 if small else 512)
    if name in ("graph_steps_1b_int8", "graph_steps_1b_fp8"):
        quant = name.rsplit("_", 1)[1]
        return graph_steps(big, dev, quant, batches[:2], (0,), compare=False)
    if name == "step_costs_1b_bf16":
        return step_costs(big, dev)
    if name == "steps_8b_bf16":
        return steps_8b(dev, small)
    if name == "syncs":
        from bench import gpu_syncs

        return gpu_syncs.measure(models, dev)
    if name == "host_time_1b_bf16":
        from bench.host_time import measure_all
        from models.spec import ModelSpec

        spec = ModelSpec(str(big), "bfloat16" if dev == "cuda" else "float32")
        return measure_all(spec, dev, (1, 4) if small else (1, 32, 64), 3 if small else 20)
    if name == "warm_up_8b_bf16":
        from bench import gpu_warm_up

        return gpu_warm_up.measure(dev, small)
    if name == "attention_8b_bf16":
        from bench.gpu_attention import measure

        return measure(dev, small)
    if name == "moe_step_bf16":
        from bench import gpu_moe

        return gpu_moe.measure(dev, small)
    raise ValueError(f"no section {name!r}; sections: {', '.join(SECTIONS)}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu_check.json"))
    ap.add_argument("--log-dir", type=Path, default=None, help="UCX logs (default: beside --out)")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; later sections skip")
    ap.add_argument("--only", nargs="*", default=None, help="these sections, in this order")
    ap.add_argument("--small", action="store_true", help="tiny 1B-section shapes (CPU dry run)")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child's one section
    ap.add_argument("--models", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.section is not None:  # a child: one section, its result or its error
        try:
            part: dict[str, Any] = {
                "result": run_section(args.section, args.models, dev, args.small, log_dir)
            }
        except Exception:  # the parent records it; the next section still runs
            part = {"error": traceback.format_exc()[-3000:]}
        args.out.write_text(json.dumps(part, indent=2))
        return
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "seconds": {},
        "errors": {},
        "skipped": [],
    }
    start = time.perf_counter()
    models = Path(tempfile.mkdtemp())
    make_models(models, dev, args.small)
    report["seconds"]["models"] = time.perf_counter() - start
    # Each section runs in a process of its own: a failed CUDA graph capture or a transport
    # that crashes costs that section alone, and a hang only its timeout.
    for name in args.only or SECTIONS:  # --only: those, in its order
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            report["skipped"].append(name)
            continue
        part_file = log_dir / f"part_{name}.json"
        cmd = [sys.executable, "-m", "bench.gpu_check", "--section", name]
        cmd += ["--models", str(models), "--out", str(part_file), "--log-dir", str(log_dir)]
        cmd += ["--small"] if args.small else []
        t0 = time.perf_counter()
        try:
            subprocess.run(cmd, timeout=min(SECTION_TIMEOUT_S, left), check=False)
        except subprocess.TimeoutExpired:
            report["errors"][name] = f"timed out after {min(SECTION_TIMEOUT_S, left):.0f} s"
        report["seconds"][name] = time.perf_counter() - t0
        if part_file.exists():
            got = json.loads(part_file.read_text())
            part_file.unlink()
            if "error" in got:
                report["errors"][name] = got["error"]
            else:
                report[name] = got["result"]
        elif name not in report["errors"]:
            report["errors"][name] = "the section's process wrote nothing (crashed)"
        shown = json.dumps(report.get(name, report["errors"].get(name)))
        print(name, f"({report['seconds'][name]:.1f} s)", shown[:4000], flush=True)
        args.out.write_text(json.dumps(report, indent=2))
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
