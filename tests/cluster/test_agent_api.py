"""What agent clients send, through a real app with speculation on (n-gram lookup, k = 3), with
the official ``openai`` client: structured outputs parsed into pydantic objects, forced and
parsed tool calls (whole and streamed), reasoning split off, vLLM's sampling extensions, and
each mistake a 400 naming its field. The model is random: what is checked is the shape the
grammar and parsers guarantee, never what a model would choose to say."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from cluster.config import TandemConfig
from tests.cluster.conftest import running_app
from tests.helpers import wait_until

pytestmark = pytest.mark.ray
TEMPLATE = Path(__file__).parents[2] / "deploy" / "templates" / "chatml_tools.jinja"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def app(tiny_folder: Path) -> Iterator[str]:
    cfg = TandemConfig.model_validate(
        {
            "mode": "colocated",
            "model": {
                "source": str(tiny_folder),
                "name": "tiny",
                "chat_template": str(TEMPLATE),
                "reasoning_parser": "think",
            },
            "draft": {"kind": "ngram", "num_speculative_tokens": 3, "adaptive": False},
            "decode": {"num_blocks": 256, "num_threads": 1},
        }
    )
    with running_app(cfg) as url:
        yield url


@pytest.fixture(scope="module")
def client(app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app}/v1", api_key="none", max_retries=0)


class Answer(BaseModel):
    """An agent's final answer: short and bounded, so a random model's turn ends by itself."""

    summary: Literal["sunny", "rainy", "noon"]
    confident: bool


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=30)
    tags: list[Literal["calm", "loud"]] = Field(max_length=3)


@pytest.mark.timeout(300)
def test_parse_returns_validated_pydantic_objects(client: openai.OpenAI) -> None:
    for seed in range(3):
        got = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": "Describe a pet."}],
            response_format=Pet,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        choice = got.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Pet)
    plain = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Any JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=120,
        temperature=0,
    )
    text = plain.choices[0].message.content or ""
    assert text.lstrip().startswith("{")  # an unbounded object: a random model may not close it
    if plain.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def _check_calls(calls: list[Any]) -> list[str]:
    names = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        assert c.id.startswith("call_") and c.type == "function"
        names.append(c.function.name)
    return names


def _streamed_calls(client: openai.OpenAI, **kw: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The calls a stream's ``tool_calls`` deltas add up to, as the SDK's users accumulate them."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                got["id"] = d.id or got["id"]
                if d.function is not None:
                    got["name"] += d.function.name or ""
                    got["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.timeout(300)
def test_required_and_named_tool_choices_force_valid_calls(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 160,
        "temperature": 0.8,
    }
    for seed in range(3):
        got = client.chat.completions.create(tool_choice="required", seed=seed, **kw)
        choice = got.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert _check_calls(choice.message.tool_calls or [])
        streamed, finish = _streamed_calls(client, tool_choice="required", seed=seed, **kw)
        assert finish == "tool_calls"
        whole = choice.message.tool_calls or []
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole
        ]
    one = client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, seed=7, **kw
    )
    assert len(one.choices[0].message.tool_calls or []) == 1
    named = client.chat.completions.create(
        tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=1, **kw
    )
    choice = named.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's, for a named function
    assert _check_calls(choice.message.tool_calls or []) == ["get_time"]
    streamed, _ = _streamed_calls(
        client, tool_choice={"type": "function", "function": {"name": "get_time"}}, seed=1, **kw
    )
    assert [c["name"] for c in streamed] == ["get_time"]
    assert json.loads(streamed[0]["arguments"]) == json.loads(
        (choice.message.tool_calls or [])[0].function.arguments
    )


HERMES_CALL = (
    r'I will check\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome)", "days": [1-7]\}\}\n</tool_call>'
)


@pytest.mark.timeout(300)
def test_auto_tool_choice_reads_calls_out_of_the_models_text(client: openai.OpenAI) -> None:
    """The model's own format (Hermes, from the template) is forced by a regex here, since a
    random model would not write it; the parser must find the call and keep the text."""
    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 80,
        "temperature": 0.7,
        "seed": 3,
        "extra_body": {"structured_outputs": {"regex": HERMES_CALL}},
    }
    got = client.chat.completions.create(**kw)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "").strip() == "I will check."  # as vLLM: text before it
    assert _check_calls(choice.message.tool_calls or []) == ["get_weather"]
    text = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text.strip() == "I will check."  # no half of the call leaks into the content
    streamed, finish = _streamed_calls(client, **kw)
    assert finish == "tool_calls" and [c["name"] for c in streamed] == ["get_weather"]


@pytest.mark.timeout(300)
def test_reasoning_is_split_off_whole_and_streamed(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 60,
        "temperature": 0.7,
        "seed": 5,
        "extra_body": {
            "structured_outputs": {"regex": r"<think>[a-z ]{3,20}</think>\n[a-z]{2,12}"}
        },
    }
    got = client.chat.completions.create(**kw)
    msg = got.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning and "<think>" not in reasoning and "</think>" not in (msg.content or "")
    assert msg.content and msg.content.strip().isalpha()
    parts, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            parts += getattr(ch.delta, "reasoning_content", None) or ""
            content += ch.delta.content or ""
    assert (parts, content) == (reasoning, msg.content)


@pytest.mark.timeout(300)
def test_vllm_sampling_extensions_reach_the_sampler(app: str) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{app}/v1/completions", json=body, timeout=60).json()
    first = httpx.post(f"{app}/tokenize", json={"prompt": r["choices"][0]["text"]}).json()
    forced = 1234
    biased = httpx.post(
        f"{app}/v1/completions", json=body | {"logit_bias": {str(forced): 100}}, timeout=60
    ).json()
    ids = httpx.post(f"{app}/tokenize", json={"prompt": biased["choices"][0]["text"]}).json()
    assert set(ids["tokens"]) == {forced} and ids["tokens"] != first["tokens"]
    allowed = [forced, forced + 1]
    only = httpx.post(
        f"{app}/v1/completions",
        json=body | {"allowed_token_ids": allowed, "temperature": 1.0, "seed": 1},
        timeout=60,
    ).json()
    got = httpx.post(f"{app}/tokenize", json={"prompt": only["choices"][0]["text"]}).json()
    assert set(got["tokens"]) <= set(allowed)
    stop = httpx.post(
        f"{app}/v1/completions",
        json=body | {"logit_bias": {str(forced): 100}, "stop_token_ids": [forced]},
        timeout=60,
    ).json()
    assert stop["choices"][0]["finish_reason"] == "stop"
    assert stop["usage"]["completion_tokens"] == 1
    held = httpx.post(
        f"{app}/v1/completions",
        json=body | {"logit_bias": {str(forced): 100}, "stop_token_ids": [forced], "min_tokens": 3},
        timeout=60,
    ).json()
    assert held["usage"]["completion_tokens"] >= 4  # stopping waited for three tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "strin"}}},
                    },
                }
            },
            "response_format",
        ),
        ({"structured_outputs": {"grammar": "start: ???"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"logit_bias": {"999999999": 5}}, "logit_bias"),
        ({"logit_bias": {"12": 500}}, "logit_bias"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0.type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
            "structured_outputs",
        ),
    ],
)
def test_mistakes_are_400s_naming_the_field(app: str, extra: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4} | extra
    r = httpx.post(f"{app}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    ok = httpx.post(
        f"{app}/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200  # and the server serves on


@pytest.mark.timeout(300)
def test_agents_sdk_runs_a_two_tool_loop(app: str) -> None:
    """The OpenAI Agents SDK's chat-completions model class: the first turn must call a tool
    (required), the SDK runs it and sends the result back, the next turn (auto) answers in the
    agent's output type (a JSON schema the server enforces)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    ran: list[tuple[str, Any]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome"], days: int) -> str:
        """Weather for a city over some days."""
        ran.append(("get_weather", (city, days)))
        return f"{city}: sunny"

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        ran.append(("get_time", zone))
        return "12:00"

    model = OpenAIChatCompletionsModel(
        model="tiny", openai_client=openai.AsyncOpenAI(base_url=f"{app}/v1", api_key="none")
    )
    agent = Agent(
        name="helper",
        instructions="Use the tools.",
        tools=[get_weather, get_time],
        model=model,
        output_type=Answer,
        model_settings=ModelSettings(
            tool_choice="required", max_tokens=160, temperature=0.8, extra_body={"seed": 2}
        ),
    )
    result = Runner.run_sync(agent, "Weather in Paris and the time?", max_turns=4)
    assert ran and {name for name, _ in ran} <= {"get_weather", "get_time"}
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(outputs) == len(ran)  # every call ran and its result went back
    assert isinstance(result.final_output, Answer)  # the next turn answered, as the schema says


RESP_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": WEATHER},
    {"type": "function", "name": "get_time", "parameters": TIME},
]


@pytest.mark.timeout(300)
def test_responses_api_whole_and_streamed(client: openai.OpenAI) -> None:
    got = client.responses.parse(
        model="tiny",
        input="Describe a pet.",
        text_format=Pet,
        max_output_tokens=120,
        extra_body={"seed": 1},
    )
    assert got.status == "completed" and isinstance(got.output_parsed, Pet)
    calls = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "Weather and time?"}],
        tools=RESP_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_output_tokens=300,
        extra_body={"seed": 2},
    )
    fc = [i for i in calls.output if i.type == "function_call"]
    assert fc and all(i.call_id.startswith("call_") for i in fc)
    for i in fc:
        jsonschema.validate(json.loads(i.arguments), SCHEMAS[i.name])
    # the conversation goes on statelessly: the calls and their outputs replayed in input
    follow = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather and time?"},
            *[
                {
                    "type": "function_call",
                    "call_id": i.call_id,
                    "name": i.name,
                    "arguments": i.arguments,
                }
                for i in fc
            ],
            *[{"type": "function_call_output", "call_id": i.call_id, "output": "fine"} for i in fc],
        ],
        tools=RESP_TOOLS,  # type: ignore[arg-type]
        max_output_tokens=12,
        extra_body={"seed": 3},
    )
    assert follow.output and follow.usage is not None and follow.usage.input_tokens > 0
    kinds, text = [], ""
    last: Any = None
    for event in client.responses.create(
        model="tiny",
        input="Say something.",
        max_output_tokens=12,
        stream=True,
        extra_body={"seed": 4},
    ):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        last = event
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert last.response.output_text == text and last.response.usage.output_tokens > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.timeout(300)
def test_agents_sdk_responses_model_runs_a_tool_loop(app: str) -> None:
    """The Agents SDK's default model class speaks /v1/responses."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        ran.append(zone)
        return "12:00"

    @function_tool
    def get_date(zone: Literal["UTC", "CET"]) -> str:
        """The date in a zone."""
        ran.append(zone)
        return "Monday"

    model = OpenAIResponsesModel(
        model="tiny", openai_client=openai.AsyncOpenAI(base_url=f"{app}/v1", api_key="none")
    )
    agent = Agent(
        name="helper",
        instructions="Use the tools.",
        tools=[get_time, get_date],
        model=model,
        output_type=Answer,
        model_settings=ModelSettings(
            tool_choice="required", max_tokens=120, extra_body={"seed": 5}
        ),
    )
    result = Runner.run_sync(agent, "What time is it?", max_turns=4)
    assert ran
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert len(outputs) == len(ran) and isinstance(result.final_output, Answer)


@pytest.mark.timeout(300)
def test_vllm_shapes_and_metric_names(app: str) -> None:
    """vLLM's per-request speculation metrics in the response, and its metric names, labelled
    with the model, on the API port's /metrics."""
    body = {"model": "tiny", "prompt": [40, 41, 42, 40, 41, 42, 40, 41], "max_tokens": 24}
    r = httpx.post(f"{app}/v1/completions", json=body | {"temperature": 0}, timeout=60).json()
    spec = r["metrics"]["speculative_decoding"]
    usage = r["usage"]["speculative"]
    assert spec["num_draft_tokens"] == usage["draft_tokens"] > 0
    assert spec["num_accepted_draft_tokens"] == usage["accepted_tokens"]
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] == usage["num_steps"]
    assert (
        sum(j * c for j, c in enumerate(spec["acceptance_histogram"])) == usage["accepted_tokens"]
    )
    # k = 3: a step tests up to k + 1 drafts (the last against the bonus row)
    assert len(spec["acceptance_histogram"]) == spec["num_spec_tokens"] + 1 <= 5

    def exported() -> dict[str, float] | None:
        text = httpx.get(f"{app}/metrics", timeout=30).text
        got: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("vllm:") and 'model_name="tiny"' in line:
                name = line.split("{")[0]
                got[name] = got.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        want = (
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_count",
            "vllm:spec_decode_num_draft_tokens_total",
            "vllm:num_requests_running",
        )
        return got if all(w in got for w in want) else None

    got = wait_until(exported, 120, "vLLM-named metrics on /metrics", interval_s=1)
    assert got["vllm:spec_decode_num_draft_tokens_total"] > 0
    assert got["vllm:generation_tokens_total"] >= 24
