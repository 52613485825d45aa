"""What ``bench/gpu_check.py`` checks on a GPU, as tests: the forward against transformers, every
attention backend the device has against the reference, bucketed steps (CUDA graphs) against
ragged ones, with int8 and fp8 weights too, and the disaggregated path (prefill, a NIXL pull of
VRAM, decode) greedy-identical to plain decoding for every drafter."""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.attention.backend import paged_attention
from models.attention.reference import ReferenceBackend
from models.kv_layout import new_kv_pool
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from runtime.backends import attention_for
from runtime.bucketed import BucketedRunner
from runtime.runner import LocalRunner, SeqInput
from tests.models.attention.cases import CASES, StepCase, in_block_major, layer_spec

pytestmark = pytest.mark.gpu

HKV, G, D, BS, NB = 4, 3, 64, 16, 200


def test_forward_matches_transformers(gpu_target: Path, device: str) -> None:
    """fp32 logits within 1e-3 of transformers'; in bf16, every position whose fp32 winner
    leads by a clear margin keeps its argmax (a random model's near-ties may flip)."""
    from transformers import LlamaForCausalLM

    ids = torch.randint(3, 4000, (70,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = LlamaForCausalLM.from_pretrained(gpu_target, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids], device=device)).logits[0].float()  # [70, V]
    top2 = theirs.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.02 * theirs.abs().max()
    assert int(clear.sum()) >= 20
    for dtype in ("float32", "bfloat16"):
        ours = ModelSpec(str(gpu_target), dtype).load(device)
        c = ours.cfg
        pool = new_kv_pool(16, c.num_kv_heads, c.num_layers, 16, c.head_dim, ours.dtype, device)
        runner = LocalRunner(ours, pool, 16)
        a = runner.run([SeqInput([3, 1, 7, 2, 9], 0, ids[:60], list(range(60)))])
        b = runner.run([SeqInput([3, 1, 7, 2, 9], 60, ids[60:], list(range(10)))])
        mine = torch.cat([a.logits, b.logits])
        if dtype == "float32":
            assert (mine - theirs).abs().max().item() <= 1e-3
        else:
            assert torch.equal(mine.argmax(-1)[clear], theirs.argmax(-1)[clear])
        assert runner.backend.attention.fallbacks == 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_major", [False, True])
@pytest.mark.parametrize("window", [None, 48])
def test_the_devices_attention_matches_the_reference(
    case: StepCase, dtype: torch.dtype, block_major: bool, window: int | None, device: str
) -> None:
    """The backend ``runtime.backends`` picks for the device, against the float64 reference
    on it: outputs to the dtype's rounding, the same K/V written (flex reads prompt chunks and
    large trees in place whatever their context, windowed or not)."""
    gen = torch.Generator().manual_seed(7)
    seqs = case.seqs(NB, BS, gen)
    t = sum(s.num_new for s in seqs)
    layer = torch.randn(NB, 2, HKV, BS, D, generator=gen).to(dtype).to(device)
    q, k, v = (
        torch.randn(t, h, D, generator=gen).to(dtype).to(device) for h in (HKV * G, HKV, HKV)
    )
    want_pool = layer.clone()
    meta = ReferenceBackend(layer_spec(want_pool, G, window), exact=True).plan(seqs)
    want = paged_attention(q, k, v, want_pool, meta, D**-0.5)
    mine = in_block_major(layer) if block_major else layer.clone()
    backend = attention_for(layer_spec(mine, G, window), dtype)
    got = paged_attention(q, k, v, mine, backend.plan(seqs), D**-0.5)
    assert torch.equal(mine, want_pool)
    tol = 3e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=max(tol, 1e-4))
    assert backend.fallbacks == 0, backend.describe()


def test_attention_reads_a_block_major_8b_pool_past_2_31_elements(device: str) -> None:
    """Llama-3.1-8B's KV shape (8 KV heads of 128, 32 layers) in a block-major pool of 2,304
    blocks: the last layer's block b starts at element b * 2**20 + 31 * 2**15, past 2**31 from
    block 2,048 on, where a kernel computing offsets in int32 would read elsewhere. A decode and
    a k = 4 verification over 1,000 cached tokens in the pool's last 64 blocks match the float64
    reference: as served (the flex kernel's guard gathers such a pool, counted) and with the
    guard lifted (whether this torch's flex reads there in place; if so, the guard can go).
    (On a CPU dry run the pool has 4 layers: the offsets stay small.)"""
    from models.attention.flex import FlexBackend
    from models.attention.flex_kernel import FlexKernel
    from models.attention.metadata import SeqSlice

    hkv, g, d, nb = 8, 4, 128, 2304
    layers = 32 if device == "cuda" else 4
    gen = torch.Generator().manual_seed(11)
    pool = torch.empty(nb, layers, 2, hkv, BS, d, dtype=torch.bfloat16, device=device)
    pool.fill_(float("nan"))  # a read outside the sequences' blocks shows
    table = list(range(nb - 64, nb))
    layer = pool[:, layers - 1]  # [NB, 2, Hkv, BS, D], block stride layers * 2**15
    layer[table] = torch.randn(64, 2, hkv, BS, d, generator=gen).to(torch.bfloat16).to(device)
    assert device != "cuda" or layer[table[0]].storage_offset() >= 2**31
    for new in (1, 5):
        seqs = [SeqSlice(table, 1000, new)]
        q, k, v = (
            torch.randn(new, h, d, generator=gen).to(torch.bfloat16).to(device)
            for h in (hkv * g, hkv, hkv)
        )
        want_pool = layer.clone()  # [NB, 2, Hkv, BS, D], contiguous
        meta = ReferenceBackend(layer_spec(want_pool, g), exact=True).plan(seqs)
        want = paged_attention(q, k, v, want_pool, meta, d**-0.5)
        served = attention_for(layer_spec(layer, g), torch.bfloat16)
        lifted = FlexBackend(layer_spec(layer, g), FlexKernel(0, max_view_elements=None))
        for backend in (served, lifted):  # each writes the same K/V into the pool
            got = paged_attention(q, k, v, layer, backend.plan(seqs), d**-0.5)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
            assert torch.equal(layer[table], want_pool[table])
        assert lifted.fallbacks == 0, lifted.describe()
        guarded = isinstance(served, FlexBackend) and served.kernel.too_large > 0
        assert served.fallbacks == (1 if guarded else 0), served.describe()


@pytest.mark.parametrize("quant", ["none", "int8", "fp8"])
def test_bucketed_steps_equal_ragged_ones(gpu_target: Path, device: str, quant: str) -> None:
    """The engine's GPU step (persistent buffers, one CUDA graph per bucket, attention in
    place) gives the ragged eager step's logits and argmax, decodes and k = 4 verifications
    over a long context, in bf16 with plain, int8 and fp8 weights."""
    if quant == "fp8" and device == "cpu":
        quant = "int8"  # fp8 is GPU-only (refused by name on a CPU): the dry run checks int8
    model = ModelSpec(str(gpu_target), "bfloat16", quant).load(device)
    c = model.cfg
    nb, batch = 80, 8

    def pool() -> torch.Tensor:
        return new_kv_pool(
            nb * batch, c.num_kv_heads, c.num_layers, BS, c.head_dim, model.dtype, device
        )

    ragged_pool, bucket_pool = pool(), pool()
    ragged = LocalRunner(model, ragged_pool, BS)
    bucketed = BucketedRunner(model, bucket_pool, BS, batch, 8, nb, graphs=True)
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    g = torch.Generator().manual_seed(3)
    prompt = [
        SeqInput(t, 0, torch.randint(3, 4000, (1000,), generator=g).tolist(), [999]) for t in tables
    ]
    ragged.run(prompt)
    bucketed.run(prompt)  # a prompt from its start: the ragged path, in both runners
    cached = 1000
    for width in (1, 1, 5, 1):
        ids = torch.randint(3, 4000, (width,), generator=g).tolist()
        step = [SeqInput(t, cached, ids, list(range(width))) for t in tables]
        want, got = ragged.run(step), bucketed.run(step)
        tol = 0.1 * float(want.logits.abs().max())
        assert float((got.logits - want.logits).abs().max()) <= tol
        agree = (got.logits.argmax(-1) == want.logits.argmax(-1)).float().mean().item()
        assert agree >= 0.9
        cached += width
    assert bucketed.bucketed_steps == 4
    attention = bucketed.backend.attention
    assert attention.fallbacks == 0, attention.describe()


def _greedy(engine: DecodeEngine, prefill: PrefillWorker | None) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (30 + 11 * i,), generator=g).tolist() for i in range(4)]
    prompts[0] = prompts[0][:10] * 4  # something n-gram lookup can predict
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


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle", "eagle_tree"])
def test_the_disaggregated_path_is_greedy_identical(
    gpu_target: Path, gpu_draft: Path, gpu_eagle: Path, device: str, drafter: str
) -> None:
    t = ModelSpec(str(gpu_target))
    eagle = ModelSpec(str(gpu_eagle))
    spec = {
        "ngram": DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4),
        "draft_model": DraftSpec(
            DraftKind.DRAFT_MODEL, ModelSpec(str(gpu_draft)), num_speculative_tokens=3
        ),
        "eagle": DraftSpec(DraftKind.EAGLE, eagle, num_speculative_tokens=3),
        "eagle_tree": DraftSpec(
            DraftKind.EAGLE, eagle, 3, adaptive=False, lookup_first=True, tree_width=3
        ),
    }[drafter]
    plain_engine = DecodeEngine(
        DecodeEngineConfig("t", t, DraftSpec(), device=device, num_blocks=128)
    )
    plain = _greedy(plain_engine, None)
    plain_engine.close()
    engine = DecodeEngine(DecodeEngineConfig("t", t, spec, device=device, num_blocks=128))
    prefill = PrefillWorker(PrefillWorkerConfig("t", t, spec, device=device, num_blocks=128))
    try:
        assert engine.pool.mem_type == ("VRAM" if device.startswith("cuda") else "DRAM")
        assert _greedy(engine, prefill) == plain
        c = engine.transport.counters
        assert c.pulls_done == 4 and c.bytes_pulled > 0
    finally:
        prefill.close()
        engine.close()


def test_a_pool_sized_from_memory_fills_the_share_and_serves(gpu_target: Path, device: str) -> None:
    """decode.gpu_memory_utilization 0.3: the pool takes what 0.3 of the device leaves after the
    model and the largest steps (profiled), at least num_blocks, and the engine then serves a
    full batch. (A CPU dry run is refused by name.)"""
    cfg = DecodeEngineConfig(
        "t",
        ModelSpec(str(gpu_target), "bfloat16"),
        device=device,
        num_blocks=256,
        gpu_memory_utilization=0.3,
        max_batch_size=16,
        step_shapes="ragged",
    )
    if device != "cuda":
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            DecodeEngine(cfg)
        return
    engine = DecodeEngine(cfg)
    _free, total = torch.cuda.mem_get_info()
    assert 256 <= engine.cfg.num_blocks == engine.allocator.num_free
    assert engine.pool.nbytes <= 0.3 * total
    assert engine.pool.nbytes >= 0.3 * total - 4 * 2**30  # a 4-layer model leaves nearly all
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reqs = [Request(uuid.uuid4().hex, [5 + i, 6, 7] * 30, params) for i in range(16)]
    for r in reqs:
        engine.add(r, None)
    while engine.has_work:
        engine.step()
    assert all(len(r.output_token_ids) == 8 for r in reqs)


def test_sampled_speculation_is_exact_on_the_device(
    small_vocab: tuple[ModelSpec, ModelSpec], device: str
) -> None:
    """On the device in bf16 (bucketed steps, CUDA graphs and the device's rejection sampling
    on a GPU): with a draft model, the second and third tokens of 3,000 seeded requests are
    distributed as plain sampling's (two-sample chi-square at 1%), and a halved temperature is
    told apart, so a real difference would show."""
    from dataclasses import replace

    from tests.decode.test_exactness import _same_distribution, _tokens

    target, draft = (replace(s, dtype="bfloat16") for s in small_vocab)
    spec = DraftSpec(DraftKind.DRAFT_MODEL, model=draft, num_speculative_tokens=3, adaptive=False)
    kw = {"num_blocks": 512, "max_batch_size": 128, "device": device}
    with_spec = DecodeEngine(DecodeEngineConfig("t", target, spec, **kw))  # type: ignore[arg-type]
    plain = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), **kw))  # type: ignore[arg-type]
    sp = SamplingParams(temperature=1.0)
    a, b = _tokens(with_spec, 3000, sp), _tokens(plain, 3000, sp)
    assert with_spec.stats().draft_tokens_fed > 0
    for position in (1, 2):
        assert _same_distribution(a[:, position], b[:, position]) > 0.01
    c = _tokens(plain, 3000, SamplingParams(temperature=0.5))
    assert _same_distribution(c[:, 1], b[:, 1]) < 0.01


@pytest.mark.parametrize(
    ("family", "quant"),
    [("qwen3-moe", "none"), ("qwen3-moe", "int8"), ("gpt-oss", "none"), ("gemma3", "none"),
     ("phi3", "none")],
)  # fmt: skip
def test_every_familys_bucketed_step_equals_its_ragged_one(
    tmp_path: Path, device: str, family: str, quant: str
) -> None:
    """The new families on the device, in bf16: a MoE's stacked experts in grouped matmuls (no
    host sync) captured in a CUDA graph (int8 experts run one by one, without graphs), gpt-oss's
    sinks on the gather path, Gemma 3's two plans a step, Phi-3's fused projections; decodes and
    a k = 4 verification."""
    from bench.family_checkpoints import family_checkpoint
    from models.moe import SparseMoE

    folder = family_checkpoint(tmp_path / family, family)
    model = ModelSpec(str(folder), "bfloat16", quant).load(device)
    c = model.cfg
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    stacked = device == "cuda" and quant == "none"
    assert all((m.gate_up is not None) == stacked for m in blocks)
    nb, batch = 20, 4

    def pool() -> torch.Tensor:
        return new_kv_pool(
            nb * batch, c.num_kv_heads, c.num_layers, BS, c.head_dim, model.dtype, device
        )

    ragged = LocalRunner(model, pool(), BS)
    bucketed = BucketedRunner(model, pool(), BS, batch, 8, nb, graphs=True)
    assert bucketed.graphs == (device == "cuda" and not (blocks and quant != "none"))
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    g = torch.Generator().manual_seed(3)
    prompt = [
        SeqInput(t, 0, torch.randint(0, 256, (200,), generator=g).tolist(), [199]) for t in tables
    ]
    ragged.run(prompt)
    bucketed.run(prompt)
    cached = 200
    for width in (1, 5, 1):
        ids = torch.randint(0, 256, (width,), generator=g).tolist()
        step = [SeqInput(t, cached, ids, list(range(width))) for t in tables]
        want, got = ragged.run(step), bucketed.run(step)
        assert float((got.logits - want.logits).abs().max()) <= 0.1 * float(want.logits.abs().max())
        cached += width
    assert bucketed.bucketed_steps == 3 and bucketed.backend.attention.fallbacks == 0


@pytest.mark.parametrize(("scheme", "kind"), [("w8a16", "int8"), ("fp8-dynamic", "fp8")])
def test_prequantized_checkpoints_serve_in_the_kernels(
    tmp_path: Path, device: str, scheme: str, kind: str
) -> None:
    """On the device a W8A16 / FP8_DYNAMIC checkpoint serves in tandem's int8 / fp8 kernels
    (a CPU dequantizes): its logits within bf16's reach of the dequantized model's."""
    from bench.quantized_checkpoints import compressed_checkpoint
    from models.quant import Quant

    folder = compressed_checkpoint(tmp_path / scheme, "qwen3", scheme)
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(1)).tolist()

    def logits(dev: str) -> tuple[torch.Tensor, Quant]:
        model = ModelSpec(str(folder), "bfloat16").load(dev)
        c = model.cfg
        pool = new_kv_pool(16, c.num_kv_heads, c.num_layers, BS, c.head_dim, model.dtype, dev)
        out = LocalRunner(model, pool, BS).run([SeqInput(list(range(8)), 0, ids, list(range(120)))])
        return out.logits.float().cpu(), model.quant

    got, served = logits(device)
    want, dense = logits("cpu")
    assert dense is Quant.NONE and served is (Quant(kind) if device == "cuda" else Quant.NONE)
    assert float((got - want).abs().max()) <= 0.1 * float(want.abs().max())


def test_overlapped_steps_serve_what_steps_read_one_by_one_serve(
    gpu_target: Path, device: str
) -> None:
    """fp32 on the device with CUDA graphs: ``decode.overlap`` on (a GPU's default) gives each
    request the tokens and ending it gets with it off. Step n + 1's inputs are staged in the
    other pinned buffer while step n's copy may be pending, its tokens come from the device,
    and step n is read through its queued copy (a stop token and an abort in the air)."""
    from tests.decode.test_overlap import _params, _prompts, _serve

    t = ModelSpec(str(gpu_target))
    prompts = _prompts(6, 20, seed=17)
    base = DecodeEngineConfig(
        "t", t, device=device, num_blocks=128, max_batch_size=8, max_model_len=512
    )
    got = {}
    for overlap in ("off", "on"):
        engine = DecodeEngine(replace(base, step_shapes="bucketed", overlap=overlap))
        reqs = [
            Request(uuid.uuid4().hex, p, sp)
            for p, sp in zip(prompts, _params("plain", 3, 2), strict=True)
        ]
        got[overlap] = _serve(engine, reqs, abort=5)
        assert engine.bucketed is not None and engine.bucketed.bucketed_steps > 10
        assert (engine.stats().steps_overlapped > 10) is (overlap == "on")
        engine.close()
    assert got["on"] == got["off"]
