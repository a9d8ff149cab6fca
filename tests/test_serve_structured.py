"""Structured output through ``hasten serve``: OpenAI's response_format and tools, vLLM's fields,
streamed and not, with n, logprobs and stop; each answer is ``Engine.generate`` with the same
constraint; bad input is a 400 naming its field, and a row whose matcher fails mid-generation fails
alone while the server goes on."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from hasten.api import Engine, make_drafter  # noqa: E402
from hasten.engine.batch import Scheduler  # noqa: E402
from hasten.serve.app import ServeOptions, create_app  # noqa: E402
from hasten.structured import Choice, Grammar, JsonSchema, Regex  # noqa: E402
from helpers import json_tokenizer, tiny_model  # noqa: E402
from test_serve import TEMPLATE, assert_error, call, start_server, stop_server  # noqa: E402

NAME = "tiny-json"
NEW = 28
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": '{"name": "ada", "age": 36} {"name": "alan", "age": 41}'}]


@pytest.fixture(scope="module")
def engine():
    tokenizer = json_tokenizer()
    tokenizer.chat_template = TEMPLATE
    model = tiny_model("llama", vocab_size=len(tokenizer))
    return Engine(model, tokenizer, make_drafter("prompt_lookup"), "prompt_lookup", draft_size="fixed")


class Breaking(Scheduler):
    """A row whose prompt ends with BREAK gets a matcher that fails after three tokens."""

    def _start(self, request, queued_seconds, reserved):
        if request.input_ids[-len(BREAK):] == BREAK and request.constraint is not None:
            request = type(request)(**{**request.__dict__, "constraint": BrokenAfter(request.constraint)})
        return super()._start(request, queued_seconds, reserved)


BREAK = [5, 6, 7]


class BrokenAfter:
    """A compiled constraint whose matchers raise once they have consumed three tokens."""

    def __init__(self, inner):
        self.inner, self.vocab_size, self.description, self.end_ids = inner, inner.vocab_size, "broken", inner.end_ids

    def matcher(self):
        matcher, inner_consume = self.inner.matcher(), None
        inner_consume = matcher.consume
        count = [0]

        def consume(token):
            if count[0] >= 3:
                raise RuntimeError("planted matcher failure")
            ok = inner_consume(token)
            count[0] += ok
            return ok

        def rollback(n):
            count[0] -= n
            type(matcher).rollback(matcher, n)

        matcher.consume, matcher.rollback = consume, rollback
        return matcher

    def tokenize(self, text):
        return self.inner.tokenize(text)

    def token_bytes(self, tokens):
        return self.inner.token_bytes(tokens)


@pytest.fixture(scope="module")
def base(engine):
    app = create_app(engine, lambda: Breaking(engine.model, engine.drafter, max_batch=4, draft_size="fixed"),
                     ServeOptions(NAME))
    server, thread, url = start_server(app)
    yield url
    stop_server(server, thread)


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def expected(engine, spec, **options) -> str:
    return engine.chat(MESSAGES, max_new_tokens=NEW, constraint=spec, **options).text


def chat(base, **fields):
    return call(base, "/v1/chat/completions", {"model": NAME, "messages": MESSAGES, "max_tokens": NEW,
                                                "temperature": 0, **fields}, key=None)


@pytest.mark.parametrize("fields, spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}},
     JsonSchema(SCHEMA)),
    ({"response_format": {"type": "json_object"}}, JsonSchema()),
    ({"guided_json": SCHEMA}, JsonSchema(SCHEMA)),
    ({"guided_regex": "[0-9]{2}-[a-z]{3}"}, Regex("[0-9]{2}-[a-z]{3}")),
    ({"guided_choice": ["yes", "no"]}, Choice(["yes", "no"])),
    ({"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}, Grammar('root ::= "yes" | "no" | "maybe"')),
    ({"structured_outputs": {"json": SCHEMA}}, JsonSchema(SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+"}}, Regex("[a-z]+")),
    ({"structured_outputs": {"choice": ["maybe", "no"]}}, Choice(["maybe", "no"])),
    ({"structured_outputs": {"json_object": True}}, JsonSchema()),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_every_field_answers_as_the_engine(engine, base, fields, spec):
    status, body = chat(base, **fields)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] == expected(engine, spec)
    assert "forced_tokens" in body["hasten"]


def test_streamed_n_logprobs_and_stop(engine, base, client):
    spec = JsonSchema(SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=NEW, temperature=0, stream=True,
                                            response_format=fmt, n=2, logprobs=True)
    texts = ["", ""]
    for event in stream:
        for choice in event.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [expected(engine, spec)] * 2
    json.loads(texts[0])
    cut = expected(engine, spec).split('"age"')[0]
    status, body = chat(base, response_format=fmt, stop=['"age"'])
    assert status == 200 and body["choices"][0]["message"]["content"] == cut
    status, body = chat(base, response_format=fmt, temperature=0.8, seed=3)  # sampled: the engine's seeded text
    assert body["choices"][0]["message"]["content"] == expected(engine, spec, temperature=0.8, seed=3)
    status, body = call(base, "/v1/completions", {"model": NAME, "prompt": MESSAGES[0]["content"], "max_tokens": NEW,
                                                  "temperature": 0, "guided_choice": ["yes", "no"]}, key=None)
    assert status == 200 and body["choices"][0]["text"] in ("yes", "no")


def test_the_official_client_parses_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=5)
        age: int = Field(ge=0, le=99)

    completion = client.chat.completions.parse(model=NAME, messages=MESSAGES, max_tokens=NEW, temperature=0,
                                               response_format=Person)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person)


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}


def test_tools_answer_as_tool_calls(engine, base, client):
    named = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=NEW, temperature=0, tools=[TOOL],
                                           tool_choice={"type": "function", "function": {"name": "lookup"}})
    call_ = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls" and call_.function.name == "lookup"
    assert call_.function.arguments == expected(engine, JsonSchema(SCHEMA))
    required = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2 * NEW, temperature=0,
                                              tools=[TOOL], tool_choice="required")
    calls = required.choices[0].message.tool_calls or []
    assert required.choices[0].finish_reason in ("tool_calls", "length")
    assert all(c.function.name == "lookup" and json.loads(c.function.arguments).keys() == {"name", "age"}
               for c in calls)
    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=NEW, temperature=0, tools=[TOOL],
                                            tool_choice={"type": "function", "function": {"name": "lookup"}},
                                            stream=True)
    deltas = [c.delta.tool_calls for e in stream for c in e.choices if c.delta.tool_calls]
    assert deltas and deltas[0][0].function.arguments == call_.function.arguments


BIG = {"type": "object", "description": "x" * (70 * 1024)}


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
    ({"guided_json": BIG}, "guided_json"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"guided_regex": "a+", "guided_choice": ["b"]}, "guided_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": 1}, "parallel_tool_calls"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"guided_choice": ["yes", "no"], "allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"guided_choice": ["yes", "no"], "ignore_eos": True}, "ignore_eos"),
    ({"guided_choice": ["no"], "min_tokens": 5}, "min_tokens"),  # "no" is complete, EOS held back: found mid-row
])
def test_bad_structured_requests_are_400_naming_the_field(engine, base, fields, param):
    assert_error(*chat(base, **fields), 400, param)
    status, body = chat(base, guided_choice=["yes", "no"])  # and the server goes on
    assert status == 200 and body["choices"][0]["message"]["content"] in ("yes", "no")


def test_a_grammar_that_cannot_finish_ends_with_length(base):
    status, body = chat(base, guided_json=SCHEMA, max_tokens=4)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


def test_a_row_whose_matcher_fails_fails_alone(engine, base):
    """Rows decode beside one whose matcher raises mid-generation: it gets the error, each other
    row its own text, and the server serves the next request."""
    fmt = {"guided_json": SCHEMA}
    broken = {"model": NAME, "prompt": BREAK, "max_tokens": NEW, "temperature": 0, **fmt}
    good = {"model": NAME, "prompt": MESSAGES[0]["content"], "max_tokens": NEW, "temperature": 0, **fmt}
    want = engine.generate(MESSAGES[0]["content"], max_new_tokens=NEW, constraint=JsonSchema(SCHEMA)).text
    with ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(call, base, "/v1/completions", good, None) for _ in range(3)]
        time.sleep(0.05)
        bad = pool.submit(call, base, "/v1/completions", broken, None).result()
        results = [answer.result() for answer in answers]
    assert bad[0] == 500 and "planted matcher failure" in bad[1]["error"]["message"]
    assert [(status, body["choices"][0]["text"]) for status, body in results] == [(200, want)] * 3
    status, body = call(base, "/v1/completions", good, key=None)
    assert status == 200 and body["choices"][0]["text"] == want


def test_a_compile_past_the_time_bound_is_a_400(base, monkeypatch):
    from hasten.structured import specs

    build, validate = specs.ENGINES["llguidance"]

    def slow(*args):
        time.sleep(0.5)
        return build(*args)

    monkeypatch.setattr(specs, "COMPILE_SECONDS", 0.1)
    monkeypatch.setitem(specs.ENGINES, "llguidance", (slow, validate))
    schema = {"type": "object", "properties": {"unseen": {"type": "string"}}}  # not in the cache
    status, body = chat(base, guided_json=schema)
    assert_error(status, body, 400, "guided_json")
    assert body["error"]["code"] == "compile_timeout"
    monkeypatch.undo()
    status, body = chat(base, guided_choice=["yes", "no"])
    assert status == 200

