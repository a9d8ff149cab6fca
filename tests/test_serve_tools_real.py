"""Tool calls in auto mode on SmolLM2-135M-Instruct through ``hasten serve`` (opt-in: ``make test-real``).

SmolLM2's chat template shows no tools, so hasten writes them into the system turn in the Hermes words
(docs/serve.md); the model then opens a call with ``<tool_call>`` as text, the lazy grammar holds the call
to the tool's schema, and the default method's answer is plain decoding's, token for token."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.real
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

import hasten  # noqa: E402
from hasten import loading  # noqa: E402
from hasten.serve.app import ServeOptions, create_app, scheduler_factory  # noqa: E402
from test_serve import call, start_server, stop_server  # noqa: E402

NAME = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
                   "required": ["city"], "additionalProperties": False}}}
# an agent's conversation so far: one call made and answered (a tool result round trip), then a new question
HISTORY = [{"role": "user", "content": "What is the weather in London?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "London"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
           {"role": "assistant", "content": "It is 12 C and raining in London."}]
ASKS = ["What is the weather in Paris?", "What is the weather in Tokyo?"]


@pytest.fixture(scope="module")
def url():
    try:
        loading.resolve_path("zoo:smollm2-135m")
    except ValueError as err:
        pytest.skip(f"zoo:smollm2-135m is not available ({err}); run `make real` first")
    engine = hasten.load("zoo:smollm2-135m", "prompt_lookup", dtype="float32")  # the default method and sizing
    app = create_app(engine, scheduler_factory(engine, 4), ServeOptions(NAME))
    server, thread, base = start_server(app)
    yield base
    stop_server(server, thread)


@pytest.mark.parametrize("ask", ASKS)
def test_smollm2_calls_a_tool_in_auto_mode_as_plain_decoding_does(url, ask):
    body = {"model": NAME, "messages": [*HISTORY, {"role": "user", "content": ask}], "tools": [WEATHER], "max_tokens": 64,
            "temperature": 0}
    status, fast = call(url, "/v1/chat/completions", body, key=None)
    status_plain, plain = call(url, "/v1/chat/completions", {**body, "speculate": False}, key=None)
    assert status == status_plain == 200, (fast, plain)
    message = fast["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    assert fast["choices"][0]["finish_reason"] == "tool_calls" and calls, message
    for made in calls:
        assert made["function"]["name"] == "get_weather"
        assert set(json.loads(made["function"]["arguments"])) == {"city"}
    plain_calls = [made["function"] for made in plain["choices"][0]["message"].get("tool_calls") or []]
    assert [made["function"] for made in calls] == plain_calls
    assert message.get("content") == plain["choices"][0]["message"].get("content")


def test_smollm2_streams_the_call_as_the_whole_answer_gives_it(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    messages = [*HISTORY, {"role": "user", "content": ASKS[1]}]
    whole = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=64,
                                           temperature=0)
    arguments, names = "", ""
    for event in client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=64,
                                                temperature=0, stream=True):
        for delta in (event.choices[0].delta.tool_calls or []) if event.choices else []:
            names += delta.function.name or ""
            arguments += delta.function.arguments or ""
    (made, *_) = whole.choices[0].message.tool_calls
    assert names.startswith(made.function.name) and arguments.startswith(made.function.arguments)
