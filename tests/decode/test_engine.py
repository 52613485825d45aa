"""The decode path in-process: prefill worker → NIXL → decode engine, against references."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from models.tokenizer import Tokenizer
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillWorker
from runtime.runner import device_name
from tests.decode.engine_utils import make_request, run_all
from tests.helpers import cpu_has_bf16_dot, cpu_panel_serves

PROMPTS = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "Write a Python function that adds two numbers.",
    "List the days of the week.",
    "Translate 'good morning' into Spanish.",
    "Count from one to ten in words.",
    "Copy this line twice: alpha beta gamma delta",
    "Explain photosynthesis in one sentence.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(embedded_folder: Path) -> list[list[int]]:
    tok = Tokenizer(embedded_folder)
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(2,))


@pytest.mark.slow
def test_greedy_disaggregated_speculative_equals_plain_and_transformers(
    embedded_folder: Path, prompts: list[list[int]]
) -> None:
    target = ModelSpec(str(embedded_folder))
    ngram = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=4)
    prefill = PrefillWorker(PrefillWorkerConfig("m", target, ngram, num_blocks=128))
    spec_engine = DecodeEngine(DecodeEngineConfig("m", target, ngram, num_blocks=256))
    plain_engine = DecodeEngine(DecodeEngineConfig("m", target, DraftSpec(), num_blocks=256))

    spec_reqs = [make_request(p, _greedy()) for p in prompts]
    spec = run_all(spec_engine, spec_reqs, prefill=prefill)
    plain_reqs = [make_request(p, _greedy()) for p in prompts]
    plain = run_all(plain_engine, plain_reqs)

    hf = LlamaForCausalLM.from_pretrained(embedded_folder, dtype=torch.float32).eval()
    for sr, pr, prompt in zip(spec_reqs, plain_reqs, prompts, strict=True):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        want = ref[0, len(prompt) :].tolist()
        assert plain[pr.request_id] == want
        assert spec[sr.request_id] == want

    drafted = sum(r.stats.num_draft_tokens for r in spec_reqs)
    accepted = sum(r.stats.num_accepted_tokens for r in spec_reqs)
    assert drafted > 0 and accepted > 0  # speculation really ran, and really accepted
    for engine in (spec_engine, plain_engine):  # the greedy rows' argmax came by the screen
        described = engine.target.describe()
        assert described["device"] == device_name(torch.device("cpu")) != "cpu: "
        assert described["torch"] == torch.__version__
        matmul = str(described["matmul"])
        screened = re.search(r"bf16 screen \((\d+) rows, 0 fell back\)", matmul)
        if cpu_has_bf16_dot():
            assert screened is not None and int(screened.group(1)) > 0
        else:  # no bf16 dot product here: the head stays whole, and says so
            want = "cpu_panel" if cpu_panel_serves() else "onednn (cpu_panel has no vector"
            assert screened is None and matmul.startswith(want), matmul

    # Decode never recomputed a prompt: every token the target was fed became an output, or was
    # a draft it rejected. (Recomputing even one prompt would add its ~45 tokens.)
    fed = spec_engine.stats().target_tokens_fed
    decoded = sum(len(v) for v in spec.values()) - len(prompts)  # the first token is prefill's
    assert decoded <= fed <= decoded + drafted - accepted
    # ... because the prompt KV came over NIXL: exactly the prompt blocks, every byte.
    blocks = sum((len(p) + 15) // 16 for p in prompts)
    block_bytes = spec_engine.pool.tensor("target")[:, 0].numel() * 4
    assert spec_engine.transport.counters.pulls_done == len(prompts)
    assert spec_engine.transport.counters.bytes_pulled == blocks * block_bytes
    # Blocks return on both sides once every request finished and every lease ended.
    assert spec_engine.allocator.num_free == 256
    assert prefill.stats().free_blocks == 128 and prefill.stats().active_leases == 0


@pytest.fixture(scope="module")
def tiny_specs(tiny_folder: Path, tiny_draft_folder: Path) -> tuple[ModelSpec, ModelSpec]:
    return ModelSpec(str(tiny_folder)), ModelSpec(str(tiny_draft_folder))


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + 7 * i,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize(
    ("mode", "quantization"),
    [("disaggregated", "none"), ("colocated", "none"), ("disaggregated", "int8")],
)
def test_draft_model_greedy_equals_plain(
    tiny_specs: tuple[ModelSpec, ModelSpec], mode: str, quantization: str
) -> None:
    """Greedy speculation is token-identical to plain decoding of the served target, also
    when target and draft serve int8 weights."""
    target, draft = (replace(s, quantization=quantization) for s in tiny_specs)
    # k pinned: at these tiny sizes a draft can cost as much as the target (int8; any dtype on
    # a CPU without the fast kernels), and adaptive speculation then rightly drafts nothing
    spec = DraftSpec(DraftKind.DRAFT_MODEL, model=draft, num_speculative_tokens=3, adaptive=False)
    engine = DecodeEngine(DecodeEngineConfig("t", target, spec, num_blocks=128))
    plain = DecodeEngine(DecodeEngineConfig("t", target, DraftSpec(), num_blocks=128))
    prefill = (
        PrefillWorker(PrefillWorkerConfig("t", target, spec, num_blocks=64))
        if mode == "disaggregated"
        else None
    )
    prompts = _prompts(4, 30, seed=7)
    sp = SamplingParams(temperature=0.0, max_tokens=20)
    a = [make_request(p, sp) for p in prompts]
    b = [make_request(p, sp) for p in prompts]
    out_a, out_b = run_all(engine, a, prefill=prefill), run_all(plain, b)
    assert [out_a[r.request_id] for r in a] == [out_b[r.request_id] for r in b]
    assert sum(r.stats.num_draft_tokens for r in a) > 0
    if prefill is not None:
        # The draft's prompt KV came in the handoff: the draft was fed only outputs (catching
        # up) and its own proposals, never a prompt (which would add 30+ tokens per request).
        decoded = sum(len(out_a[r.request_id]) for r in a) - len(a)
        drafted = sum(r.stats.num_draft_tokens for r in a)
        assert engine.stats().draft_tokens_fed <= decoded + drafted


def test_draft_equal_to_target_is_always_accepted(tiny_specs: tuple[ModelSpec, ModelSpec]) -> None:
    """With the target as its own draft, greedy acceptance is total: proves the shipped draft
    KV and the draft's rollback are right (a stale or missing draft position would diverge)."""
    target, _ = tiny_specs
    # k pinned: adaptive speculation would stop drafting a draft as dear as the target
    spec = DraftSpec(DraftKind.DRAFT_MODEL, model=target, num_speculative_tokens=4, adaptive=False)
    engine = DecodeEngine(DecodeEngineConfig("t", target, spec, num_blocks=128))
    prefill = PrefillWorker(PrefillWorkerConfig("t", target, spec, num_blocks=64))
    reqs = [
        make_request(p, SamplingParams(temperature=0.0, max_tokens=21)) for p in _prompts(3, 25, 8)
    ]
    handoffs_probe = []
    run_all(engine, reqs, prefill=prefill)
    for r in reqs:
        assert r.stats.num_draft_tokens == r.stats.num_accepted_tokens == 20  # every output
        handoffs_probe.append(r.acceptance_estimate)
    assert all(p == pytest.approx(1.0) for p in handoffs_probe)


def test_seeded_sampling_is_reproducible_and_batch_independent(
    tiny_specs: tuple[ModelSpec, ModelSpec],
) -> None:
    target, draft = tiny_specs
    spec = DraftSpec(DraftKind.DRAFT_MODEL, model=draft, num_speculative_tokens=3)
    engine = DecodeEngine(DecodeEngineConfig("t", target, spec, num_blocks=256))
    prompt = _prompts(1, 20, seed=9)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, seeded=True)
    alone = make_request(prompt, sp)
    out_alone = run_all(engine, [alone])[alone.request_id]
    crowd = [
        make_request(p, SamplingParams(temperature=1.0, max_tokens=16, seed=i))
        for i, p in enumerate(_prompts(3, 15, 10))
    ]
    again = make_request(prompt, sp)
    out = run_all(engine, [*crowd, again])
    assert out[again.request_id] == out_alone
    other = make_request(prompt, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99))
    assert run_all(engine, [other])[other.request_id] != out_alone


def test_abort_and_expired_lease_free_every_block(tiny_specs: tuple[ModelSpec, ModelSpec]) -> None:
    target, _ = tiny_specs
    engine = DecodeEngine(
        DecodeEngineConfig("t", target, DraftSpec(), num_blocks=64, kv_failure_policy="fail")
    )
    prefill = PrefillWorker(
        PrefillWorkerConfig("t", target, DraftSpec(), num_blocks=32, lease_seconds=30)
    )
    sp = SamplingParams(temperature=0.0, max_tokens=50)
    r1, r2 = (make_request(p, sp) for p in _prompts(2, 40, 11))
    engine.add(r1, prefill.prefill(r1))
    for _ in range(3):
        engine.step()
    engine.abort(r1.request_id)
    deadline = time.monotonic() + 10
    while engine.allocator.num_free < 64 and time.monotonic() < deadline:
        engine.step()  # a read still landing keeps its blocks until the transport says it ended
    assert engine.allocator.num_free == 64
    # A handoff whose lease has run out is refused cleanly, and prefill reclaims the blocks.
    h2 = prefill.prefill(r2)
    expired = time.monotonic() + h2.lease_seconds + 1
    prefill.reap(now=expired)
    assert prefill.stats().cooling_blocks > 0  # a read started just in time may still land
    prefill.reap(now=expired + prefill.cfg.lease_grace_s)
    assert prefill.stats().free_blocks == 32
    engine.add(r2, h2.__class__(**{**h2.__dict__, "lease_seconds": 0.0}))
    outs = engine.step()
    assert outs and outs[0].finish_reason == "error" and "lease" in (outs[0].error or "")
    assert engine.allocator.num_free == 64


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_the_intake_beside_a_step_serves_what_the_intake_before_it_does(
    tiny_specs: tuple[ModelSpec, ModelSpec], mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU the intake (transfers progressed, queued requests admitted, landed KV pulls
    started) also runs while the device computes a step, so the next step's start finds it
    done: forced here on the CPU, requests arriving one a step while others decode get the
    tokens they get without it, and it runs before that step's read."""
    import decode.spec_step

    target, _ = tiny_specs
    spec = DraftSpec(DraftKind.NGRAM, num_speculative_tokens=3, adaptive=False)
    prompts = _prompts(5, 20, seed=3)
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    events: list[str] = []
    read_once = decode.spec_step._read_once

    def read(*args: Any) -> Any:
        events.append("read")
        return read_once(*args)

    monkeypatch.setattr(decode.spec_step, "_read_once", read)
    outs = {}
    for beside in (False, True):
        prefill = (
            PrefillWorker(PrefillWorkerConfig("t", target, spec, num_blocks=64))
            if mode == "disaggregated"
            else None
        )
        engine = DecodeEngine(DecodeEngineConfig("t", target, spec, num_blocks=128))
        engine.intake_beside_step = beside
        intake = engine._intake_beside

        def watched(_intake: Callable[[], None] = intake) -> None:
            events.append("intake")
            _intake()

        monkeypatch.setattr(engine, "_intake_beside", watched)
        reqs = [make_request(p, sp) for p in prompts]
        got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        done: set[str] = set()
        arriving = list(reqs)
        steps: list[list[str]] = []
        deadline = time.monotonic() + 120
        while len(done) < len(reqs) and time.monotonic() < deadline:
            if arriving:  # one a step, while the others decode
                r = arriving.pop(0)
                handoff = prefill.prefill(r) if prefill is not None else None
                if handoff is not None:
                    got[r.request_id].append(handoff.first_token)
                engine.add(r, handoff)
            events.clear()
            for o in engine.step():
                assert o.error is None, o.error
                got[o.request_id].extend(o.new_token_ids)
                if o.finished:
                    done.add(o.request_id)
            steps.append(list(events))
        engine.close()
        assert len(done) == len(reqs)
        outs[beside] = [got[r.request_id] for r in reqs]
        ran = [s for s in steps if "read" in s]
        assert ran
        assert all(s == (["intake", "read"] if beside else ["read"]) for s in ran), steps
    assert outs[True] == outs[False]
