"""API keys, request limits and admission over real HTTP (colocated app, tiny random model),
and a schema-driven fuzz of the generation endpoints: no input may produce a 5xx."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion

from cluster.config import TandemConfig
from tests.cluster.conftest import running_app
from tests.helpers import wait_until

pytestmark = pytest.mark.ray

KEYS = tuple(f"sk-tandem-test-key-{i}-000{i}" for i in range(4))


@pytest.fixture(scope="module")
def app(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    keys = tmp_path_factory.mktemp("auth") / "keys"
    keys.write_text("# test keys\n" + "\n\n".join(KEYS) + "\n")
    cfg = TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "decode": {
                "num_blocks": 256,
                "num_threads": 1,
                "max_ongoing_requests": 2,
                "max_queued_requests": 1,
            },
            "ingress": {"replicas": 1},  # the limits below are per ingress replica
            "auth": {"api_keys_file": str(keys), "api_keys_env": "TANDEM_TEST_NO_SUCH_VAR"},
            "limits": {
                "max_tokens": 1800,
                "default_max_tokens": 8,
                "max_body_bytes": 8192,
                "max_concurrent_per_key": 1,
                "max_inflight": 4,
            },
        }
    )
    with running_app(cfg) as url:
        yield url


def _client(app: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app}/v1", api_key=key, max_retries=0, timeout=60)


def _error(r: httpx.Response) -> dict[str, Any]:
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_keys_are_required_except_for_health(app: str) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        _client(app, "sk-not-a-key-at-all-0000").completions.create(
            model="tiny", prompt="hi", max_tokens=2
        )
    assert e.value.status_code == 401
    r = httpx.get(f"{app}/v1/models", timeout=30)  # no header at all
    assert r.status_code == 401 and _error(r)["code"] == "invalid_api_key"
    r = httpx.get(f"{app}/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"}, timeout=30)
    assert r.status_code == 401
    assert KEYS[0] not in r.text
    anonymous = httpx.get(f"{app}/health", timeout=30)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    health = httpx.get(f"{app}/health", headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30)
    assert health.status_code == 200 and health.json()["admission"]["rejected"]["401"] >= 3
    for key in KEYS:
        out = _client(app, key).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert out.usage is not None and out.usage.completion_tokens == 2


def test_limits_name_themselves(app: str) -> None:
    client = _client(app, KEYS[0])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1801)
    assert "limits.max_tokens" in e.value.message and "1800" in e.value.message
    r = httpx.post(
        f"{app}/v1/completions",
        headers={"Authorization": f"Bearer {KEYS[0]}"},
        json={"model": "tiny", "prompt": "x" * 9000, "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 413 and "limits.max_body_bytes" in _error(r)["message"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.usage is not None and chat.usage.completion_tokens <= 8  # default_max_tokens


def test_one_key_one_stream_at_a_time(app: str) -> None:
    client = _client(app, KEYS[0])
    stream = client.completions.create(
        model="tiny", prompt="tell me a story", max_tokens=1500, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # the first stream is running now
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"
    assert "limits.max_concurrent_per_key" in e.value.message
    other = _client(app, KEYS[1]).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert other.usage is not None  # another key is not held back
    stream.close()  # the client goes away; its slot is freed
    for _ in range(50):
        try:
            out = client.completions.create(model="tiny", prompt="hi", max_tokens=2)
            break
        except openai.RateLimitError:
            threading.Event().wait(0.2)
    assert out.usage is not None and out.usage.completion_tokens == 2


def test_a_full_decode_queue_answers_429(app: str) -> None:
    streams = []
    for key in KEYS[:2]:  # the decode replica's two slots
        s = _client(app, key).completions.create(
            model="tiny", prompt="a long one", max_tokens=1500, temperature=0, stream=True
        )
        next(iter(s))
        streams.append(s)
    # Two more at once, each in a thread: whichever comes first takes the queue's one place
    # and waits for a slot, the other finds the queue full (no wait for either to get there).
    outcomes: dict[str, Completion | openai.RateLimitError] = {}

    def send(key: str) -> None:
        try:
            outcomes[key] = _client(app, key).completions.create(
                model="tiny", prompt="hi", max_tokens=2
            )
        except openai.RateLimitError as e:
            outcomes[key] = e

    pair = [threading.Thread(target=send, args=(key,), daemon=True) for key in KEYS[2:]]
    for t in pair:
        t.start()

    def refused() -> list[openai.RateLimitError]:
        return [o for o in outcomes.values() if isinstance(o, openai.RateLimitError)]

    (e,) = wait_until(refused, 60, "one of the two refused")
    assert "decode.max_queued_requests" in e.message
    assert e.response.headers["retry-after"] == "1"
    for s in streams:
        s.close()
    for t in pair:
        t.join(60)
    assert not any(t.is_alive() for t in pair)
    served = [o for o in outcomes.values() if isinstance(o, Completion)]
    assert len(served) == 1 and served[0].usage is not None  # the queued one, once a slot freed
    ok = _client(app, KEYS[3]).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.usage is not None


# text with lone surrogates (legal as JSON escapes, not as Unicode) besides ordinary letters
_TEXT = st.text(max_size=20) | st.text(
    alphabet=st.characters(codec=None, categories=["Cs", "Ll", "Nd"]), max_size=20
)
_HUGE = st.sampled_from([2**31, 2**63, 10**30, -(10**30), 10**400])


def _nested(depth: int) -> Any:
    out: Any = 0
    for _ in range(depth):
        out = [out]
    return out


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | _HUGE | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
) | st.integers(30, 800).map(_nested)
_TYPED = {
    "string": _TEXT | st.sampled_from(["[" * 100_000, '{"a":' * 5000]),
    "integer": st.sampled_from([-1, 0, 1, 2, 3, 2**31, 2**63, 10**30, 10**400]),
    "number": st.sampled_from([-1.0, 0.0, 0.5, 1.0, 2.5, float("inf")]),
    "boolean": st.booleans(),
    "array": st.lists(st.integers(-5, 60_000) | st.text(max_size=10), max_size=5),
    "object": st.dictionaries(st.text(max_size=8), _JSON, max_size=3),
}


def _types(prop: dict[str, Any]) -> list[str]:
    found = [prop["type"]] if "type" in prop else []
    for alt in prop.get("anyOf", []):
        found += _types(alt)
    return found or ["object"]


def _schema_props(app: str, endpoint: str) -> dict[str, Any]:
    spec = httpx.get(f"{app}/openapi.json", headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
    body = spec["paths"][endpoint]["post"]["requestBody"]["content"]["application/json"]
    name = body["schema"]["$ref"].rsplit("/", 1)[1]
    props: dict[str, Any] = spec["components"]["schemas"][name]["properties"]
    return props


@st.composite
def _bodies(draw: st.DrawFn, props: dict[str, Any]) -> bytes:
    if draw(st.integers(0, 9)) == 0:  # sometimes not even JSON
        return draw(st.binary(max_size=64))
    body: dict[str, Any] = {}
    for name, prop in props.items():
        choice = draw(st.integers(0, 5))
        if choice == 0:
            continue
        if choice == 1:
            body[name] = draw(_JSON)
        else:
            body[name] = draw(_TYPED.get(draw(st.sampled_from(_types(prop))), _JSON))
    if draw(st.booleans()):
        body["model"] = "tiny"
    if "messages" in props and draw(st.booleans()):
        body["messages"] = [{"role": "user", "content": draw(_TEXT)}]
    body.pop("stream", None)  # streams are fuzzed by the non-streaming path's validation
    return json.dumps(body, allow_nan=True).encode()


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_bodies_never_break_the_server(app: str, endpoint: str) -> None:
    props = _schema_props(app, endpoint)
    seen: dict[int, int] = {}
    headers = {"Authorization": f"Bearer {KEYS[1]}", "Content-Type": "application/json"}

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_bodies(props))
    def one(body: bytes) -> None:
        r = httpx.post(f"{app}{endpoint}", content=body, headers=headers, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body, r.text)
        if r.status_code != 200:
            _error(r)

    one()
    assert seen.get(400, 0) > 0  # the fuzzer reached validation
    ok = _client(app, KEYS[1]).completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert ok.usage is not None
    assert httpx.get(f"{app}/health", timeout=30).json()["status"] == "ok"
