"""A hostile-input battery against a running tandem app, over HTTP and gRPC: lone surrogates,
deep nesting, huge numbers, out-of-vocabulary ids, invalid UTF-8, oversized and slow bodies,
header floods, a temperature below the floor, and streams aborted by the dozen. Every case
must be a 4xx naming its field or limit, or a correct 200: never a 5xx, never a hang; after it
every KV block, lease and admission slot is back and greedy output is unchanged.

    .venv/bin/python -m bench.hostile            # launches a disaggregated app with a key

Writes bench/results/hostile.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from cluster.proto import tandem_pb2 as pb
from cluster.proto import tandem_pb2_grpc

RESULTS = Path(__file__).parent / "results"
BENCH_KEY = "sk-tandem-hostile-bench-key-0001"
SURROGATE = "a\ud800b"
GREEDY = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Any  # a JSON value, or raw bytes sent as they are
    allowed: tuple[int, ...]
    names: str | None  # what the error's param or message must name


@dataclass(frozen=True)
class Outcome:
    name: str
    status: int  # HTTP status, or the HTTP status a gRPC code stands for; 0: no answer
    ok: bool
    detail: str


def _cases(model: str, vocab: int) -> list[Case]:
    greedy = {"model": model, **GREEDY}
    deep_args = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 20_000}}
        ],
    }
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    nan = b'{"model": "%s", "prompt": "a", "temperature": NaN}' % model.encode()
    return [
        Case(
            "surrogate prompt", "/v1/completions", {**greedy, "prompt": SURROGATE}, (400,), "prompt"
        ),
        Case(
            "surrogate content",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": SURROGATE}]},
            (400,),
            "messages.0.content",
        ),
        Case(
            "surrogate name",
            "/v1/chat/completions",
            {**chat, "messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
            (400,),
            "messages.0.name",
        ),
        Case("surrogate model", "/v1/completions", {**greedy, "model": SURROGATE}, (400,), "model"),
        Case("surrogate tokenize", "/tokenize", {"prompt": SURROGATE}, (400,), "prompt"),
        Case(
            "deep tool arguments",
            "/v1/chat/completions",
            {**chat, "messages": [*chat["messages"], deep_args]},
            (400,),
            "arguments",
        ),
        Case(
            "deep body",
            "/v1/completions",
            {**greedy, "metadata": json.loads("[" * 200 + "]" * 200)},
            (400,),
            "metadata",
        ),
        Case(
            "deeper than JSON parsers", "/v1/completions", b'{"a": ' + b"[" * 30_000, (400,), None
        ),
        Case("top_k 10**30", "/v1/completions", {**greedy, "top_k": 10**30}, (400,), "top_k"),
        Case(
            "top_k past vocab", "/v1/completions", {**greedy, "top_k": vocab + 1}, (400,), "top_k"
        ),
        Case("n 10**30", "/v1/completions", {**greedy, "n": 10**30}, (400,), "n"),
        Case(
            "max_tokens 10**30",
            "/v1/completions",
            {**greedy, "max_tokens": 10**30},
            (400,),
            "max_tokens",
        ),
        Case(
            "logprobs 10**9", "/v1/completions", {**greedy, "logprobs": 10**9}, (400,), "logprobs"
        ),
        Case("seed 2**64", "/v1/completions", {**greedy, "seed": 2**64}, (400,), "seed"),
        Case(
            "token id = vocab",
            "/v1/completions",
            {**greedy, "prompt": [1, vocab]},
            (400,),
            "prompt",
        ),
        Case("negative token id", "/detokenize", {"tokens": [-1]}, (400,), "tokens"),
        Case(
            "invalid utf-8",
            "/v1/completions",
            b'{"model": "m", "prompt": "\xff\xfe"}',
            (400,),
            None,
        ),
        Case("not json", "/v1/completions", b"\x00\x01{{", (400,), None),
        Case("NaN temperature", "/v1/completions", nan, (400,), "temperature"),
        Case(
            "2 MB body",
            "/v1/completions",
            {**greedy, "prompt": "x" * 2_000_000},
            (413,),
            "limits.max_body_bytes",
        ),
        Case(
            "many stops", "/v1/completions", {**greedy, "stop": list("abcdefghij")}, (400,), "stop"
        ),
        Case(
            "a 5,000-char stop", "/v1/completions", {**greedy, "stop": "z" * 5000}, (400,), "stop"
        ),
    ]


def _post(base: str, key: str, path: str, body: Any) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{base}{path}", content=raw, headers=headers, timeout=60)


def http_cases(base: str, key: str, model: str, vocab: int) -> list[Outcome]:
    out = []
    for c in _cases(model, vocab):
        try:
            r = _post(base, key, c.path, c.body)
        except httpx.HTTPError as e:
            out.append(Outcome(c.name, 0, False, f"no answer: {e}"))
            continue
        named = True
        if c.names is not None and r.status_code >= 400:
            err = r.json()["error"]
            named = c.names in (err["param"] or "") + err["message"]
        out.append(
            Outcome(c.name, r.status_code, r.status_code in c.allowed and named, r.text[:200])
        )
    return out


def tiny_temperature(base: str, key: str, model: str) -> Outcome:
    """temperature=1e-40 served as greedy: the same text as temperature 0."""
    greedy = _post(base, key, "/v1/completions", {"model": model, **GREEDY})
    tiny = _post(base, key, "/v1/completions", {"model": model, **GREEDY, "temperature": 1e-40})
    same = tiny.status_code == 200 and tiny.json()["choices"] == greedy.json()["choices"]
    return Outcome("temperature 1e-40", tiny.status_code, same, tiny.text[:200])


def header_flood(base: str, key: str, model: str) -> Outcome:
    flood = {f"x-flood-{i}": "y" * 200 for i in range(400)}
    try:
        r = httpx.post(
            f"{base}/v1/completions",
            json={"model": model, **GREEDY},
            headers={"Authorization": f"Bearer {key}", **flood},
            timeout=30,
        )
    except httpx.HTTPError as e:  # the server closed the connection on the oversized head
        return Outcome("header flood", 0, True, f"closed: {e}")
    ok = r.status_code == 200 or 400 <= r.status_code < 500  # served, or refused by the proxy
    return Outcome("header flood", r.status_code, ok, r.text[:200])


def slow_body(base: str, key: str, model: str, timeout_s: float) -> Outcome:
    """A body trickling in slower than ``limits.body_timeout_s``: 408, naming the limit."""
    host, port = base.removeprefix("http://").split(":")
    body = json.dumps({"model": model, **GREEDY}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=timeout_s + 30) as s:
        s.sendall(head.encode() + body[:5])
        time.sleep(timeout_s + 1)
        answer = s.recv(65536).decode(errors="replace")
    status = int(answer.split(" ", 2)[1]) if answer.startswith("HTTP/") else 0
    return Outcome("slow body", status, status == 408 and "body_timeout_s" in answer, answer[:200])


async def aborted_streams(base: str, key: str, model: str, count: int) -> Outcome:
    """Streams cut off by their clients after the first line, ``count`` at once."""
    statuses: list[int] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, **GREEDY, "max_tokens": 400, "stream": True, "seed": i}
        async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
            statuses.append(r.status_code)
            async for _ in r.aiter_lines():
                return

    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        await asyncio.gather(*(one(client, i) for i in range(count)))
    ok = statuses == [200] * count
    return Outcome(f"{count} aborted streams", 200 if ok else max(statuses), ok, str(statuses))


_HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 413,
    grpc.StatusCode.NOT_FOUND: 404,
}


def grpc_cases(port: int, key: str, model: str, vocab: int, body_limit: int) -> list[Outcome]:
    auth = (("authorization", f"Bearer {key}"),)
    cases: list[tuple[str, list[int], dict[str, Any], grpc.StatusCode | None, str | None]] = [
        (
            "grpc oversized",
            [40_000] * (body_limit // 2),  # 3 bytes an id: past the limit
            {},
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "max",  # Serve's gRPC proxy ("larger than max"), or the ingress (max_body_bytes)
        ),
        ("grpc top_k", [5, 6], {"top_k": 2**31 - 1}, grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (
            "grpc stops",
            [5, 6],
            {"stop": list("abcdefghij")},
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop",
        ),
        (
            "grpc max_tokens",
            [5, 6],
            {"max_tokens": 2**32 - 1},
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_tokens",
        ),
        ("grpc token id", [vocab + 5], {}, grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (
            "grpc long stop",
            [5, 6],
            {"stop": ["z" * 5000]},
            grpc.StatusCode.INVALID_ARGUMENT,
            "stop",
        ),
        ("grpc temperature 1e-30", [5, 6], {"temperature": 1e-30}, None, None),
    ]
    out = []
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = tandem_pb2_grpc.TandemStub(ch)
        for name, ids, sampling, want, names in cases:
            req = pb.GenerateRequest(
                model=model,
                token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingOptions(**{"max_tokens": 4, **sampling}),
            )
            try:
                list(stub.Generate(req, metadata=auth, timeout=60))
                code, details = grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
            status = 200 if code is grpc.StatusCode.OK else _HTTP_OF.get(code, 500)
            ok = code is (want or grpc.StatusCode.OK) and (names is None or names in details)
            out.append(Outcome(name, status, ok, details[:200]))
    return out


def settled(base: str, key: str) -> dict[str, Any]:
    """What must be back after the battery: blocks, leases, requests, admission slots."""
    h = httpx.get(f"{base}/health", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    d = h["decode"]
    out = {
        "decode_free_blocks": d["free_blocks"],
        "decode_num_blocks": d["num_blocks"],
        "decode_requests": d["running"] + d["waiting"] + d["pulling"],
        "inflight": h["admission"]["inflight"],
        "kv_recomputed": d["kv_recomputed"],
        "dropped_handoffs": h.get("dropped_handoffs", 0),
    }
    if "prefill" in h:
        p = h["prefill"]
        out |= {"prefill_leases": p["active_leases"], "prefill_cooling": p["cooling_blocks"]}
    return out


def is_settled(s: dict[str, Any]) -> bool:
    return bool(
        s["decode_free_blocks"] == s["decode_num_blocks"]
        and s["decode_requests"] == s["inflight"] == s.get("prefill_leases", 0) == 0
        and s.get("prefill_cooling", 0) == 0  # no lease ran out: each was read or given back
    )


def vocab_size(base: str, key: str) -> int:
    """The served vocabulary's size, as the server's refusal of an id past it states it."""
    refusal = _post(base, key, "/detokenize", {"tokens": [2**31 - 1]}).json()["error"]["message"]
    found = re.search(r"\[0, (\d+)\)", refusal)
    assert found is not None, refusal
    return int(found[1])


def battery(
    base: str, grpc_port: int, key: str, body_limit: int, body_timeout_s: float
) -> dict[str, Any]:
    """Run every case; the report's ``outcomes`` say, case by case, whether it was answered as
    it must be. ``base``: the server's root URL (no ``/v1``)."""
    headers = {"Authorization": f"Bearer {key}"}
    model = httpx.get(f"{base}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    vocab = vocab_size(base, key)
    before = _post(base, key, "/v1/completions", {"model": model, **GREEDY}).json()["choices"]
    outcomes = http_cases(base, key, model, vocab)
    outcomes.append(tiny_temperature(base, key, model))
    outcomes.append(header_flood(base, key, model))
    outcomes.append(slow_body(base, key, model, body_timeout_s))
    outcomes.append(asyncio.run(aborted_streams(base, key, model, 24)))
    outcomes += grpc_cases(grpc_port, key, model, vocab, body_limit)
    deadline = time.monotonic() + 60
    state = settled(base, key)
    while not is_settled(state) and time.monotonic() < deadline:
        time.sleep(0.5)
        state = settled(base, key)
    after = _post(base, key, "/v1/completions", {"model": model, **GREEDY}).json()["choices"]
    return {
        "outcomes": [asdict(o) for o in outcomes],
        "cases": len(outcomes),
        "failed": [o.name for o in outcomes if not o.ok],
        "server_errors": sum(o.status >= 500 for o in outcomes),
        "no_answer": sum(o.status == 0 and not o.ok for o in outcomes),
        "settled": state,
        "settled_ok": is_settled(state),
        "greedy_unchanged": before == after,
    }


def main() -> None:
    from bench.serve import launched, parse_args

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--launch", choices=("disaggregated", "colocated"), default="disaggregated")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys"
        keys.write_text(BENCH_KEY + "\n")
        limit, slow = 65536, 2.0
        sets = [
            f"auth.api_keys_file={keys}",
            f"limits.max_body_bytes={limit}",
            f"limits.body_timeout_s={slow}",
            "grpc.enabled=true",
        ]
        argv = ["--launch", a.launch, "--draft", "ngram"]
        for item in sets:
            argv += ["--set", item]
        args = parse_args(argv)
        with launched(args) as (base, cfg):
            report = battery(base.removesuffix("/v1"), cfg["grpc"]["port"], BENCH_KEY, limit, slow)
    report["mode"] = a.launch
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "hostile.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "outcomes"}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
