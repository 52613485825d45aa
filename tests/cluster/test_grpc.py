"""The gRPC API (tandem.v1) through Ray Serve's gRPC proxy, driven by a grpcio client: the
same outputs, validation, auth and usage as HTTP; health, reflection; a cancelled stream frees
its blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cluster.config import TandemConfig
from cluster.proto import tandem_pb2 as pb
from cluster.proto import tandem_pb2_grpc
from tests.cluster.conftest import running_app_ports
from tests.helpers import wait_until

pytestmark = pytest.mark.ray

KEY = "sk-tandem-grpc-test-key-0001"
AUTH = (("authorization", f"Bearer {KEY}"),)
BLOCKS = 128


@pytest.fixture(scope="module")
def app(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    keys = tmp_path_factory.mktemp("grpc_auth") / "keys"
    keys.write_text(KEY + "\n")
    cfg = TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {"source": str(tiny_folder), "name": "tiny"},
            "draft": {"kind": "ngram", "num_speculative_tokens": 3},
            "decode": {"num_blocks": BLOCKS, "num_threads": 1},
            "auth": {"api_keys_file": str(keys), "api_keys_env": "TANDEM_TEST_NO_SUCH_VAR"},
            "limits": {"max_model_len": 1024},
        }
    )
    with running_app_ports(cfg) as ports:
        yield ports


@pytest.fixture(scope="module")
def channel(app: tuple[str, int]) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{app[1]}") as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> Any:
    return tandem_pb2_grpc.TandemStub(channel)


PROMPT = [5, 17, 99, 1024, 5, 17, 99, 1024, 5, 17]


def _request(**sampling: Any) -> Any:
    return pb.GenerateRequest(
        model="tiny",
        token_ids=pb.TokenIds(ids=PROMPT),
        sampling=pb.SamplingOptions(**sampling),
    )


def _collect(stub: Any, request: Any) -> tuple[str, list[Any]]:
    responses = list(stub.Generate(request, metadata=AUTH, timeout=120))
    return "".join(r.text for r in responses), responses


def test_generate_matches_http_streamed_or_not(stub: Any, app: tuple[str, int]) -> None:
    sampling = {"temperature": 0.0, "max_tokens": 24, "logprobs": 2}
    whole_text, whole = _collect(stub, _request(**sampling))
    assert len(whole) == 1 and whole[0].finish_reason in ("stop", "length")
    streaming = _request(**sampling)
    streaming.stream = True
    streamed_text, parts = _collect(stub, streaming)
    assert len(parts) > 1 and streamed_text == whole_text
    assert all(not p.finish_reason for p in parts[:-1]) and parts[-1].finish_reason
    usage = whole[0].usage
    assert usage.completion_tokens == parts[-1].usage.completion_tokens
    assert usage.prompt_tokens == len(PROMPT)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert len(whole[0].logprobs) == usage.completion_tokens
    assert sum(len(p.logprobs) for p in parts) == usage.completion_tokens
    assert all(len(lp.top) == 2 and lp.logprob <= 0.0 for lp in whole[0].logprobs)
    r = httpx.post(
        f"{app[0]}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == whole_text
    assert body["usage"]["completion_tokens"] == usage.completion_tokens


def test_chat_and_list_models_and_health(stub: Any, channel: grpc.Channel) -> None:
    chat = pb.GenerateRequest(
        model="tiny",
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi there")]),
        sampling=pb.SamplingOptions(max_tokens=5, seed=7),
    )
    _, responses = _collect(stub, chat)
    assert responses[-1].usage.completion_tokens >= 1
    models = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=30)
    assert [m.id for m in models.models] == ["tiny"] and models.models[0].max_model_len == 1024
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= names


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (_request(temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "'temperature'"),
        (_request(max_tokens=5000), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (_request(top_k=-5), grpc.StatusCode.INVALID_ARGUMENT, "'top_k'"),
        (pb.GenerateRequest(model="tiny"), grpc.StatusCode.INVALID_ARGUMENT, "'prompt'"),
        (
            pb.GenerateRequest(model="gpt-5", text="hello"),
            grpc.StatusCode.NOT_FOUND,
            "'gpt-5' does not exist",
        ),
        (
            pb.GenerateRequest(model="tiny", token_ids=pb.TokenIds(ids=[10**7])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the vocabulary",
        ),
    ],
    ids=["temperature", "max_tokens", "top_k", "no prompt", "model", "vocabulary"],
)
def test_bad_input_gets_the_http_message_as_a_grpc_status(
    stub: Any, request_: Any, code: grpc.StatusCode, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as e:
        _collect(stub, request_)
    assert e.value.code() == code and words in (e.value.details() or ""), e.value.details()
    _, ok = _collect(stub, _request(max_tokens=2))  # and it keeps serving
    assert ok[-1].usage.completion_tokens == 2


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer sk-wrong-key-000000000"),)])
def test_a_missing_or_wrong_key_is_unauthenticated(stub: Any, metadata: Any) -> None:
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(_request(max_tokens=2), metadata=metadata, timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in (e.value.details() or "")
    with pytest.raises(grpc.RpcError) as e:
        stub.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_cancelled_stream_frees_its_blocks(stub: Any, app: tuple[str, int]) -> None:
    request = _request(max_tokens=600, ignore_eos=True)
    request.stream = True
    call = stub.Generate(request, metadata=AUTH, timeout=120)
    got = [next(call), next(call)]
    assert all(not r.finish_reason for r in got)
    keyed = {"Authorization": f"Bearer {KEY}"}
    during = httpx.get(f"{app[0]}/health", headers=keyed, timeout=30).json()["decode"]
    assert during["running"] == 1 and during["free_blocks"] < BLOCKS
    call.cancel()

    def freed() -> bool:
        h = httpx.get(f"{app[0]}/health", headers=keyed, timeout=30).json()["decode"]
        assert h["free_blocks"] == BLOCKS and h["running"] == 0, h
        return True

    wait_until(freed, 30, "the cancelled stream's blocks freed", interval_s=0.2)
