"""The disaggregated app on a real local Ray cluster, driven by the official openai client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import LlamaForCausalLM

from cluster.config import TandemConfig
from models.config import LlamaConfig
from models.embedded import EMBEDDED_NAME
from models.sampling import choice_seed
from models.tokenizer import Tokenizer
from tests.cluster.conftest import running_app
from tests.helpers import cpu_has_bf16_dot, cpu_panel_serves, wait_until

pytestmark = pytest.mark.ray

MODEL = EMBEDDED_NAME
CFG = TandemConfig.model_validate(
    {
        "mode": "disaggregated",
        "draft": {"kind": "ngram", "num_speculative_tokens": 4},
        "prefill": {"num_blocks": 256, "num_threads": 2},
        "decode": {"num_blocks": 512, "num_threads": 2},
        "limits": {"max_model_len": 2048},
        "kv": {"path_check": True},
    }
)


@pytest.fixture(scope="module")
def base(embedded_folder: Path) -> Iterator[str]:
    with running_app(CFG) as url:
        yield url


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _health(base: str) -> dict[str, Any]:
    r = httpx.get(f"{base}/health", timeout=30)
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body


def test_models_and_health(client: openai.OpenAI, base: str) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = _health(base)
    assert h["status"] == "ok" and h["mode"] == "disaggregated" and h["kv_transport"] == "nixl"

    def measured() -> dict[str, Any] | None:
        pools = _health(base)["pools"]
        paths = [r["kv_path"] for p in pools.values() for r in p["replicas"].values()]
        return pools if paths and all("gbps" in p for p in paths) else None

    pools = wait_until(measured, 120, "every replica's KV path check")
    for pool in pools.values():
        for r in pool["replicas"].values():
            path = r["kv_path"]  # the transport UCX chose for reads, and what they gave
            assert path["gbps"] > 0 and path["transports"] and not path["emulated"], path
            assert path["fabric"].startswith("tcp") and path["degraded"] is None
    # and the path between the pools: a prefill replica's probe, read from a decode replica
    cross = wait_until(
        lambda: (c := _health(base)["kv_path_cross_pool"]).get("state") != "measuring" and c,
        120,
        "the cross-pool KV path check",
    )
    assert cross.get("error") is None and cross["gbps"] > 0 and cross["transports"], cross
    assert cross["from"]["replica"] in pools["prefill"]["replicas"], cross
    assert cross["to"]["replica"] in pools["decode"]["replicas"], cross
    assert cross["crosses_nodes"] is False and cross["degraded"] is None  # one node here


def test_replicas_apply_process_settings_and_prefill_gives_heap_back_when_idle(
    client: openai.OpenAI, base: str
) -> None:
    client.completions.create(model=MODEL, prompt="Count to five:", max_tokens=4)

    def released() -> dict[str, Any]:
        prefill: dict[str, Any] = _health(base)["pools"]["prefill"]["replicas"]
        assert any(r["heap_releases"] >= 1 for r in prefill.values()), prefill
        return prefill

    # the replica gives memory back at most once a second, once idle
    prefill = wait_until(released, 30, "idle prefill giving heap back", interval_s=0.5)
    assert all(r["onednn_cache_capacity"] == 64 for r in prefill.values()), prefill  # the default
    decode = _health(base)["pools"]["decode"]["replicas"]
    assert all(r["onednn_cache_capacity"] is None for r in decode.values()), decode
    # decode attention read the pool in place (models.cpu.paged), with no step gathering
    assert all(r["attention"] == "cpu_paged" for r in decode.values()), decode
    assert all(r["attention_fallbacks"] == 0 for r in decode.values()), decode
    # and its matmuls took the row-invariant panel kernel (models.cpu.linear) where the CPU
    # has AVX-512 (else oneDNN, by name), greedy rows' argmax through the LM head's bf16
    # screen (models.cpu.greedy_head) on a CPU with the bf16 dot product
    screened = "cpu_panel; greedy rows' argmax by a bf16 screen"
    panel = cpu_panel_serves()
    want = screened if cpu_has_bf16_dot() else "cpu_panel" if panel else "onednn (cpu_panel"
    assert all(r["matmul"].startswith(want) for r in decode.values()), decode
    assert cpu_has_bf16_dot() or not any(screened in r["matmul"] for r in decode.values())
    # and its decoder layers ran as one C call a step (models.cpu.program), which needs the
    # panel kernel
    layers = "program" if panel else "modules (a matmul outside the panel kernel"
    assert all(r["layers"].startswith(layers) for r in decode.values()), decode
    for pool in (prefill, decode):  # the pools' default reached each replica's interpreter
        assert all(r["switch_interval_s"] == pytest.approx(2e-4) for r in pool.values()), pool


def test_chat_completion(client: openai.OpenAI, embedded_folder: Path) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    prompt_len = len(Tokenizer(embedded_folder).apply_chat_template(msgs))
    assert r.usage is not None and r.usage.prompt_tokens == prompt_len
    assert 0 < r.usage.completion_tokens <= 20
    assert r.usage.total_tokens == prompt_len + r.usage.completion_tokens


def test_greedy_completion_matches_transformers(
    client: openai.OpenAI, embedded_folder: Path
) -> None:
    tok = Tokenizer(embedded_folder)
    hf = LlamaForCausalLM.from_pretrained(embedded_folder, dtype=torch.float32).eval()
    for text in ("The three primary colors are", "def fibonacci(n):\n    "):
        ids = tok.encode(text)
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids) :]
        ref_ids = ref.tolist()
        if 2 in ref_ids:
            ref_ids = ref_ids[: ref_ids.index(2) + 1]
        r = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
        assert r.choices[0].text == tok.decode(ref_ids)
        assert r.usage is not None and r.usage.completion_tokens == len(ref_ids)


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 30, "temperature": 0}
    whole = client.completions.create(prompt="Once upon a time", **kw)
    parts, finishes, usage = [], [], None
    for chunk in client.completions.create(
        prompt="Once upon a time", stream=True, stream_options={"include_usage": True}, **kw
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finishes.append(chunk.choices[0].finish_reason)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(parts) == whole.choices[0].text
    assert finishes[-1] == whole.choices[0].finish_reason and all(f is None for f in finishes[:-1])
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens

    msgs: Any = [{"role": "user", "content": "Name three fruits."}]
    chat_whole = client.chat.completions.create(messages=msgs, **kw)
    deltas = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(messages=msgs, stream=True, **kw)
        if c.choices
    ]
    assert "".join(deltas) == chat_whole.choices[0].message.content


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "Tell me a very short story about a cat."}]
    kw: dict[str, Any] = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 0.95,
    }
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    others = {
        client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (8, 9)
    }
    assert a == b
    assert others != {a}


def test_speculation_counters_match_usage(client: openai.OpenAI, base: str) -> None:
    """The replica's counters (exported to Prometheus as tandem_spec_*) move by exactly what
    the response's usage.speculative reports."""
    before = _health(base)["decode"]["speculation"]
    r = client.completions.create(
        model=MODEL, prompt="a b c d a b c d a b c d a b", max_tokens=24, temperature=0
    )
    after = _health(base)["decode"]["speculation"]
    spec = (r.usage.model_extra or {})["speculative"] if r.usage else {}
    assert spec["draft_tokens"] > 0
    assert after["draft_tokens"] - before["draft_tokens"] == spec["draft_tokens"]
    assert after["accepted_tokens"] - before["accepted_tokens"] == spec["accepted_tokens"]
    rates = [x for x in after["acceptance_by_position"] if x is not None]
    assert rates and all(0.0 <= x <= 1.0 for x in rates)


def test_stop_string_truncates(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=[" 7"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == " 5, 6,"


def test_kv_came_over_nixl(client: openai.OpenAI, base: str, embedded_folder: Path) -> None:
    ids = Tokenizer(embedded_folder).encode("The history of the Roman Empire " * 20)  # ~120 tokens
    before = _health(base)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    after = _health(base)
    assert r.usage is not None
    d0, d1 = before["decode"], after["decode"]
    c = LlamaConfig.from_folder(embedded_folder)
    blocks = (len(ids) + 15) // 16
    block_bytes = c.num_layers * c.num_kv_heads * c.head_dim * 2 * 16 * 4  # (k, v), 16 tokens, fp32
    assert d1["transport"] == "nixl"
    assert d1["transfer"]["pulls_done"] == d0["transfer"]["pulls_done"] + 1
    assert d1["transfer"]["bytes_pulled"] - d0["transfer"]["bytes_pulled"] == blocks * block_bytes
    fed = d1["target_tokens_fed"] - d0["target_tokens_fed"]
    assert 0 < fed < len(ids)  # decode never ran the prompt through the target
    assert (
        after["prefill"]["transfer"]["exports_completed"]
        > before["prefill"]["transfer"]["exports_completed"]
    )


def test_n_choices_share_one_prefill_and_each_is_its_seeds_sample(
    client: openai.OpenAI, base: str
) -> None:
    """n = 3, seeded: each choice is the sample a lone request with that choice's seed gives,
    streamed or not; usage counts every choice; one prefill served all three."""
    msgs: Any = [{"role": "user", "content": "Tell me a very short story about a dog."}]
    kw: dict[str, Any] = {"model": MODEL, "messages": msgs, "max_tokens": 16, "temperature": 1.0}
    prefills = _health(base)["prefill"]["prefills"]
    r = client.chat.completions.create(n=3, seed=11, **kw)
    assert _health(base)["prefill"]["prefills"] == prefills + 1
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == 3
    tokens = 0
    for i, text in enumerate(texts):
        lone = client.chat.completions.create(seed=choice_seed(11, i), **kw)
        assert lone.choices[0].message.content == text
        assert lone.choices[0].finish_reason == r.choices[i].finish_reason
        assert lone.usage is not None
        tokens += lone.usage.completion_tokens
    assert r.usage is not None and r.usage.completion_tokens == tokens  # every choice's

    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    finishes: dict[int, str | None] = {}
    usage = None
    for chunk in client.chat.completions.create(
        n=3, seed=11, stream=True, stream_options={"include_usage": True}, **kw
    ):
        for c in chunk.choices:
            assert c.index not in finishes  # nothing of a choice after its finish
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    assert [streamed[i] for i in range(3)] == texts
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, n=CFG.limits.max_choices + 1
        )
    assert e.value.param == "n" and "limits.max_choices" in str(e.value.message)


def test_abandoned_stream_frees_decode_blocks(base: str) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": "Write a long essay about the history of the sea."}
        ],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    total = CFG.decode.num_blocks
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as resp:
        events = (line for line in resp.iter_lines() if line.startswith("data: "))
        got = [next(events) for _ in range(4)]
        during = _health(base)["decode"]
    assert all('"finish_reason": null' in e for e in got)  # still generating when we left
    assert during["running"] == 1 and during["free_blocks"] < total

    def freed() -> dict[str, Any]:
        h = _health(base)
        assert h["decode"]["free_blocks"] == total and h["decode"]["running"] == 0, h["decode"]
        return h

    h = wait_until(freed, 30, "the abandoned stream's blocks freed")
    assert h["prefill"]["free_blocks"] == CFG.prefill.num_blocks


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD: list[tuple[str, str, Any, int, str | None]] = [
    ("chat", "malformed json", "{not json", 400, None),
    ("chat", "unknown model", {**GOOD, "model": "gpt-5"}, 404, "model"),
    ("chat", "missing messages", {"model": MODEL}, 400, "messages"),
    ("completions", "missing prompt", {"model": MODEL}, 400, "prompt"),
    ("chat", "max_tokens zero", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", "max_tokens negative", {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
    ("chat", "max_tokens beyond context", {**GOOD, "max_tokens": 10**6}, 400, "max_tokens"),
    ("completions", "prompt beyond context", {"model": MODEL, "prompt": [5] * 3000}, 400, "prompt"),
    ("chat", "negative temperature", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("chat", "top_p zero", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("chat", "top_p above one", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("chat", "temperature wrong type", {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("chat", "messages wrong type", {**GOOD, "messages": "hello"}, 400, "messages"),
    ("chat", "max_tokens wrong type", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    (
        "completions",
        "token id outside vocabulary",
        {"model": MODEL, "prompt": [10**7]},
        400,
        "prompt",
    ),
]


@pytest.mark.parametrize(
    ("endpoint", "case", "body", "status", "param"), BAD, ids=[b[1] for b in BAD]
)
def test_bad_input_is_refused_and_server_keeps_serving(
    base: str, endpoint: str, case: str, body: Any, status: int, param: str | None
) -> None:
    url = f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    if isinstance(body, str):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param
        assert param in err["message"] or status == 404
    ok = httpx.post(f"{base}/v1/chat/completions", json=GOOD, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_fields_the_server_does_not_implement_are_refused_by_name(client: openai.OpenAI) -> None:
    """Through the SDK, as a client would send them: each refused field is a 400 naming it,
    the inert ones are accepted, and the server keeps serving."""
    msgs: Any = [{"role": "user", "content": "Hi"}]
    for name, value in [
        ("reasoning_effort", "low"),
        ("web_search_options", {}),
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("store", True),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=2, **{name: value}
            )
        assert (e.value.param, e.value.code) == (name, "unsupported_parameter")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, suffix="end")
    assert e.value.param == "suffix"
    r = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=2,
        user="u-1",
        metadata={"team": "a"},
        service_tier="flex",
        prediction={"type": "content", "content": "Hello"},
        tools=[],
        n=1,
    )
    assert r.choices[0].message.role == "assistant" and r.usage is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, extra_body={"frobnicate": 1.2})
    assert (e.value.param, e.value.code) == ("frobnicate", "unknown_parameter")


def test_ignore_eos_generates_to_max_tokens(client: openai.OpenAI) -> None:
    """vLLM's ``ignore_eos`` (benchmark clients send it): the same greedy text, continued past
    the end-of-sequence token to ``max_tokens``."""
    msgs: Any = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage is not None
    assert plain.usage.completion_tokens < 48
    more = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
    )
    assert more.choices[0].finish_reason == "length" and more.usage is not None
    assert more.usage.completion_tokens == 48
    assert (more.choices[0].message.content or "").startswith(
        plain.choices[0].message.content or ""
    )


def test_tool_results_replay_and_dropped_tool_calls_are_refused(client: openai.OpenAI) -> None:
    history: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check."},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=3)
    assert r.usage is not None and r.usage.completion_tokens >= 1
    history[1] = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
        ],
    }
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=history, max_tokens=3)
    assert e.value.param == "messages.1.tool_calls"


def test_tokenize_detokenize_and_model_card(client: openai.OpenAI, base: str) -> None:
    """vLLM's shapes: the chat count equals the usage a chat request reports, and detokenize
    inverts tokenize."""
    msgs = [{"role": "user", "content": "Count these tokens, please."}]
    t = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": msgs}, timeout=30)
    assert t.status_code == 200, t.text
    body = t.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 2048
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)  # type: ignore[arg-type]
    assert r.usage is not None and r.usage.prompt_tokens == body["count"]
    text = "Grüße, 世界! 🌍"
    t = httpx.post(f"{base}/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(t["token_strs"]) == t["count"] == len(t["tokens"])
    d = httpx.post(f"{base}/detokenize", json={"model": MODEL, "tokens": t["tokens"]})
    assert d.status_code == 200 and d.json() == {"prompt": text}
    for url, payload, param in [
        ("tokenize", {"prompt": "a", "messages": msgs}, None),
        ("detokenize", {"tokens": [10**8]}, "tokens"),
        ("detokenize", {"tokens": [1], "model": "gpt-5"}, "model"),
    ]:
        bad = httpx.post(f"{base}/{url}", json=payload, timeout=30)
        assert bad.status_code in (400, 404) and bad.json()["error"]["param"] == param, bad.text
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-5")
    assert e.value.code == "model_not_found"


def test_logprobs_are_the_targets_through_the_api(
    client: openai.OpenAI, embedded_folder: Path
) -> None:
    """Greedy with n-gram speculation on a copy-heavy prompt: the reported log-probabilities,
    streamed or not, completions or chat, are transformers' log-softmax of the same tokens."""
    tok = Tokenizer(embedded_folder)
    hf = LlamaForCausalLM.from_pretrained(embedded_folder, dtype=torch.float32).eval()
    text = "Copy: red green blue red green blue red green blue red green"
    ids = tok.encode(text)
    ref = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=20,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = ref.sequences[0, len(ids) :].tolist()
    want = [
        torch.log_softmax(step[0].float(), dim=-1) for step in ref.logits[: len(out)]
    ]  # per output position, [V]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(prompt=ids, logprobs=3, **kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert whole.usage is not None and len(lp.token_logprobs) == whole.usage.completion_tokens
    assert len(lp.token_logprobs) == len(out)
    assert (whole.usage.model_extra or {})["speculative"]["accepted_tokens"] > 0  # drafts passed
    for j, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert value == pytest.approx(float(want[j][out[j]]), abs=1e-4)
        assert sorted(top.values(), reverse=True) == pytest.approx(
            want[j].topk(3).values.tolist(), abs=1e-4
        )
    assert lp.text_offset is not None and lp.text_offset[0] == 0
    assert "".join(lp.tokens or []) == whole.choices[0].text
    streamed: list[float] = []
    for chunk in client.completions.create(prompt=ids, logprobs=3, stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)

    msgs: Any = [{"role": "user", "content": text}]
    chat = client.chat.completions.create(messages=msgs, logprobs=True, top_logprobs=2, **kw)
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and chat.usage is not None and len(content) == chat.usage.completion_tokens
    assert all(
        len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content
    )
    joined = b"".join(bytes(c.bytes or []) for c in content)
    assert joined.startswith((chat.choices[0].message.content or "").encode())
    chunks = [
        c.choices[0].logprobs.content or []
        for c in client.chat.completions.create(
            messages=msgs, logprobs=True, top_logprobs=2, stream=True, **kw
        )
        if c.choices and c.choices[0].logprobs is not None
    ]
    assert [c.logprob for part in chunks for c in part] == pytest.approx(
        [c.logprob for c in content], abs=1e-4
    )
    plain = client.chat.completions.create(messages=msgs, **kw)
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=msgs, top_logprobs=2, **kw)
    assert e.value.param == "top_logprobs"


def test_grammars_and_processors_cross_the_handoff(client: openai.OpenAI, base: str) -> None:
    """Prefill samples the first token under the grammar and the processors; decode goes on
    from it (its own grammar state advanced past it): the whole output is valid."""
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    msgs: Any = [{"role": "user", "content": "Plan a trip as JSON."}]
    for seed in range(2):
        r = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=64,
            seed=seed,
            temperature=0.8,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "trip", "schema": schema},
            },
            presence_penalty=0.5,
        )
        assert r.choices[0].finish_reason == "stop"
        got = json.loads(r.choices[0].message.content or "")
        assert got["city"] in ("Paris", "Rome") and isinstance(got["days"], int)
    first = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=1, temperature=0, logit_bias={"1234": 100}
    )  # the one token, sampled on prefill
    want = httpx.post(f"{base}/detokenize", json={"tokens": [1234]}, timeout=30).json()["prompt"]
    assert first.choices[0].text == want
