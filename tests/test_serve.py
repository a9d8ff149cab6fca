"""``hasten serve`` and ``hasten serve-bench``, end to end over HTTP.

One server runs in this process (uvicorn in a thread, 127.0.0.1, a free port) over a tiny
random Llama with prompt lookup, the continuous-batching scheduler and an API key; the
tests talk to it with the official ``openai`` client, and with raw HTTP where they need to
send what no client would. Its outputs are compared with ``Engine.generate`` / ``chat``.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")
uvicorn = pytest.importorskip("uvicorn", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hasten.api import Engine, make_drafter  # noqa: E402
from hasten.engine.batch import Scheduler  # noqa: E402
from hasten.serve.app import ServeOptions, create_app  # noqa: E402
from hasten.serve.schema import DEFAULT_MAX_TOKENS  # noqa: E402
from hasten.engine.stops import TextStream  # noqa: E402
from helpers import VOCAB, save_checkpoint, tiny_model, tiny_tokenizer  # noqa: E402

KEY = "sk-test"
NAME = "tiny"
MAX_BATCH = 4  # below the 8 concurrent requests, so some wait for a free row
BODY_LIMIT = 8192
NEW = 24
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
PROMPTS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "def add(a, b):\n",
    "for i in range(3):\n",
    "return a + b\n\ndef",
    "print(i)\nprint(",
    "def range(a):\n    return a\n",
    "for a in b:\n    add(a, b)\n",
]


class PacedScheduler(Scheduler):
    """The real scheduler, made to take at least ``PACE["seconds"]`` a step, so a test can
    be sure a long row is still running when its client leaves."""

    PACE = {"seconds": 0.0}

    def step(self):
        time.sleep(self.PACE["seconds"])
        return super().step()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    # fixed draft sizes: the tests compare step counts, which auto sizing ties to measured times
    return Engine(tiny_model("llama"), tokenizer, make_drafter("prompt_lookup"), "prompt_lookup", draft_size="fixed")


def start_server(app) -> tuple[uvicorn.Server, threading.Thread, str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


def stop_server(server, thread) -> None:
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def base(engine):
    def make():
        return PacedScheduler(engine.model, engine.drafter, max_batch=MAX_BATCH, draft_size=engine.draft_size)

    app = create_app(engine, make, ServeOptions(NAME, KEY, BODY_LIMIT))
    server, thread, url = start_server(app)
    yield url
    stop_server(server, thread)


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)


def reference(engine, prompt: str, max_new_tokens: int = NEW):
    return engine.generate(prompt, max_new_tokens=max_new_tokens)


def call(base, path, body=None, key=KEY, raw: bytes | None = None, method=None):
    """(status, parsed JSON or text) of one raw HTTP request."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, text = response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metrics(base) -> dict[str, float]:
    """Every sample of /metrics as {"name{label=value,...}": value}."""
    status, text = call(base, "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


# ---- outputs equal the library's -----------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_generate(engine, client, stream):
    expected = reference(engine, PROMPTS[0])
    answer = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stream=stream,
                                       stream_options={"include_usage": True} if stream else None)
    if stream:
        chunks = list(answer)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        usage, extra = chunks[-1].usage, chunks[-1].model_extra
        assert chunks[-1].choices == []  # the usage chunk comes last, with no choice
    else:
        choice, usage, extra = answer.choices[0], answer.usage, answer.model_extra
        text, reason = choice.text, choice.finish_reason
    assert text == expected.text
    assert reason == ("stop" if len(expected.token_ids) < NEW else "length")
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.prompt_tokens == engine.encode(PROMPTS[0]).shape[1]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stats = extra["hasten"]
    assert stats["method"] == "prompt_lookup" and stats["steps"] == expected.stats.steps
    assert stats["tau"] == pytest.approx(expected.stats.mean_accepted, abs=1e-3)
    assert stats["acceptance_by_position"] == pytest.approx(expected.stats.acceptance_by_position, abs=1e-3)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions_equal_engine_chat(engine, client, stream):
    messages = [{"role": "system", "content": "You repeat code."}, {"role": "user", "content": PROMPTS[1]}]
    expected = engine.chat(messages, max_new_tokens=NEW)
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0,
                                            stream=stream)
    if stream:
        chunks = list(answer)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason is not None and "hasten" in chunks[-1].model_extra
    else:
        assert answer.choices[0].message.role == "assistant"
        text = answer.choices[0].message.content
        assert answer.usage.completion_tokens == len(expected.token_ids)
    assert text == expected.text


def test_token_id_prompts_and_max_completion_tokens(engine, base):
    ids = engine.encode(PROMPTS[0])[0].tolist()
    status, body = call(base, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": NEW, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == reference(engine, PROMPTS[0]).text
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPTS[2]}]}]
    status, body = call(base, "/v1/chat/completions",
                        {"model": NAME, "messages": messages, "max_completion_tokens": 5, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] <= 5
    assert body["choices"][0]["message"]["content"] == engine.chat(
        [{"role": "user", "content": PROMPTS[2]}], max_new_tokens=5).text


def test_eight_concurrent_streams_each_equal_their_single_output(engine, base):
    expected = [reference(engine, p).text for p in PROMPTS]
    singles = [call(base, "/v1/completions", {"model": NAME, "prompt": p, "max_tokens": NEW, "temperature": 0})[1]
               for p in PROMPTS]
    assert [s["choices"][0]["text"] for s in singles] == expected

    async def one(client, prompt):
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60) as client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    before = metrics(base)
    PacedScheduler.PACE["seconds"] = 0.01  # a row takes long enough for the others to arrive while it runs
    try:
        assert asyncio.run(all_at_once()) == expected
    finally:
        PacedScheduler.PACE["seconds"] = 0.0
    after = metrics(base)
    # they really ran together: some step decoded more than one row
    batched = lambda m: m["hasten_step_batch_size_count{}"] - m["hasten_step_batch_size_bucket{le=1.0}"]  # noqa: E731
    assert batched(after) > batched(before)


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_get_one_choice_each_equal_to_single_requests(engine, client, stream):
    """A list of prompts (strings or token ids) is answered in order, each choice the text a
    single request gets; usage adds every prompt's tokens and every choice's."""
    prompts = [PROMPTS[0], PROMPTS[1], engine.encode(PROMPTS[2])[0].tolist()]
    singles = [client.completions.create(model=NAME, prompt=p, max_tokens=NEW, temperature=0) for p in prompts]
    answer = client.completions.create(model=NAME, prompt=prompts, max_tokens=NEW, temperature=0, stream=stream,
                                       stream_options={"include_usage": True} if stream else None)
    if stream:
        texts, reasons, usage = ["", "", ""], [None] * 3, None
        for chunk in answer:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            usage = chunk.usage or usage
    else:
        assert [c.index for c in answer.choices] == [0, 1, 2]
        texts, reasons, usage = [c.text for c in answer.choices], [c.finish_reason for c in answer.choices], answer.usage
    assert texts == [single.choices[0].text for single in singles]
    assert reasons == [single.choices[0].finish_reason for single in singles]
    assert usage.prompt_tokens == sum(single.usage.prompt_tokens for single in singles)
    assert usage.completion_tokens == sum(single.usage.completion_tokens for single in singles)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_of_a_seeded_request_sample_with_seed_plus_their_index(client, stream):
    """Choice j of a seeded request with n choices is the single request seeded with seed + j."""
    options = dict(model=NAME, max_tokens=NEW, temperature=1.0)
    singles = [client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[1]}], seed=11 + j,
                                              **options).choices[0].message.content for j in range(3)]
    answer = client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[1]}], seed=11, n=3,
                                            stream=stream, **options)
    if stream:
        texts, roles = ["", "", ""], set()
        for chunk in answer:
            for choice in chunk.choices:
                roles |= {choice.index} if choice.delta.role == "assistant" else set()
                texts[choice.index] += choice.delta.content or ""
        assert roles == {0, 1, 2}  # every choice opens with the assistant's role
    else:
        texts = [choice.message.content for choice in answer.choices]
    assert texts == singles
    assert len(set(singles)) > 1  # the choices are different samples


def test_best_of_returns_the_samples_with_the_highest_mean_log_probability(client):
    """best_of 4, n 2, seeded: the choices are the two of the four single requests (seeds
    seed + j) whose tokens have the highest mean log-probability, in sampling order; usage
    counts all four samples."""
    options = dict(model=NAME, prompt=PROMPTS[1], max_tokens=NEW, temperature=1.0)
    singles = [client.completions.create(seed=21 + j, logprobs=0, **options) for j in range(4)]
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in (s.choices[0] for s in singles)]
    assert len(set(means)) == 4  # distinct samples, so the ranking is decided
    best = sorted(sorted(range(4), key=lambda j: -means[j])[:2])
    answer = client.completions.create(seed=21, n=2, best_of=4, **options)
    assert [c.index for c in answer.choices] == [0, 1] and all(c.logprobs is None for c in answer.choices)
    assert [c.text for c in answer.choices] == [singles[j].choices[0].text for j in best]
    assert answer.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert answer.usage.prompt_tokens == singles[0].usage.prompt_tokens


def test_a_seed_makes_sampling_reproducible(client):
    texts = {client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, top_p=0.9,
                                       seed=7).choices[0].text for _ in range(2)}
    assert len(texts) == 1


# ---- stop strings -------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_the_text_ends_before_the_stop_string(engine, client, stream):
    full = reference(engine, PROMPTS[0], 40).text
    stop = full[8:11]
    assert len(stop) == 3 and full.find(stop) >= 1
    answer = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "@@@"],
                                       stream=stream)
    if stream:
        chunks = list(answer)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = chunks[-1].choices[0].finish_reason
    else:
        text, reason = answer.choices[0].text, answer.choices[0].finish_reason
    assert text == full[: full.find(stop)]
    assert reason == "stop"


def test_text_stream_holds_back_what_may_become_a_stop_string():
    tokenizer = tiny_tokenizer()
    ids = tokenizer("def add(a, b):\n    return a + b\n").input_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    stream = TextStream(tokenizer, ["return a - b", "b)"])
    shown = "".join(stream.push([t]) for t in ids)
    assert shown == text[: text.find("b)")] and stream.stopped and stream.finish() == ""

    stream = TextStream(tokenizer, ["return a - b"])
    pieces, held = [], []
    for i, token in enumerate(ids):
        pieces.append(stream.push([token]))
        decoded = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        if stream.shown != decoded:
            held.append(decoded[len(stream.shown) :])
    assert "".join(pieces) + stream.finish() == text and not stream.stopped
    # "return a " could still become the stop string until "+" rules it out
    assert held and all("return a - b".startswith(tail) for tail in held)


@pytest.mark.parametrize("stop", [[], ["b)"], ["return a - b"]])
def test_a_text_stream_nobody_reads_decodes_once_and_ends_with_the_same_text(stop):
    """Engine.generate and chat read no pieces: the stream decodes the text once, at the end,
    instead of the whole sequence at every step, and the text is the streamed one."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer("def add(a, b):\n    return a + b\n").input_ids
    streamed = TextStream(tokenizer, stop)
    expected = "".join(streamed.push([t]) for t in ids) + streamed.finish()
    decodes = []
    quiet = TextStream(tokenizer, stop, streaming=False)
    quiet._decode = lambda real=quiet._decode: decodes.append(1) or real()
    assert all(quiet.push([t]) == "" for t in ids)
    assert quiet.finish() == expected and quiet.stopped == streamed.stopped and len(decodes) == 1


# ---- errors: 401, 400, 404, 413 -------------------------------------------------------------------
def assert_error(status, body, expected_status, param):
    assert status == expected_status, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_a_missing_or_wrong_key_is_401_and_health_is_open(base, key):
    for path, body in (("/v1/models", None), ("/v1/completions", {"model": NAME, "prompt": "x"}), ("/metrics", None)):
        status, answer = call(base, path, body, key=key)
        assert_error(status, answer, 401, None)
        assert answer["error"]["code"] == "invalid_api_key"
    assert call(base, "/health", key=None) == (200, {"status": "ok"})
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key=key or "none", max_retries=0).models.list()


BAD_BODIES = [
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 10**9}, "max_tokens"),  # checked at admission, against the prompt's ids
    ({"prompt": "x", "max_tokens": 4.5}, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 17}, "n"),  # more than MAX_CHOICES
    ({"prompt": "x", "n": 1.5}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3, "stream": True}, "best_of"),  # the best are known only at the end
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),  # fewer samples than choices
    ({"prompt": "x", "best_of": 17}, "best_of"),  # more than MAX_CHOICES
    ({"prompt": ["a", ""]}, "prompt"),  # each of several prompts is checked
    ({"prompt": ["a"] * 65}, "prompt"),  # more than MAX_PROMPTS
    ({"prompt": ["a", [10**6]]}, "prompt"),
    ({"prompt": "x", "stop": 3}, "stop"),
    ({"prompt": "x", "seed": "s"}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),  # above the 20 alternatives a token may list
    ({"prompt": "x", "logprobs": True}, "logprobs"),  # a completion's logprobs is a count
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5] * 600}, "prompt"),  # longer than the model's 512 positions
    ({"prompt": [5] * 500, "max_tokens": 20}, "max_tokens"),  # fits, but not with 20 more
    ({"prompt": [10**6]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "model": 123}, "model"),
    ({"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate: no tokenizer can read it
    # fields that would change the answer are refused, never silently ignored
    ({"prompt": [5, 6], "response_format": {"type": "json_object"}}, "response_format"),  # no token writes "{"
    ({"prompt": "x", "functions": [{"name": "f"}]}, "functions"),
    # the fields that transform the target distribution, out of range (vLLM's and OpenAI's bounds)
    ({"prompt": [5, 6], "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": [5, 6], "stop_token_ids": [VOCAB + 1]}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": 5}, "stop_token_ids"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": [5, 6], "min_tokens": 8, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": -1.2}, "repetition_penalty"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ({"prompt": [5, 6], "allowed_token_ids": [5, VOCAB]}, "allowed_token_ids"),
    ({"prompt": "x", "logit_bias": {"five": 3}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias"),
    ({"prompt": [5, 6], "logit_bias": {str(VOCAB): 3}}, "logit_bias"),
    ({"prompt": [5, 6], "logit_bias": {"-1": 3}}, "logit_bias"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # not streamed, as vLLM
    ({"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
]


@pytest.mark.parametrize("body, param", BAD_BODIES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_BODIES)])
def test_bad_completion_requests_are_400_naming_the_field(base, body, param):
    assert_error(*call(base, "/v1/completions", {"model": NAME, **body}), 400, param)


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["x"]}, "messages[0]"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": 7, "content": "x"}]}, "messages[0].role"),  # any role the template renders, as a string
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": None}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0]"),
])
def test_bad_chat_requests_are_400_naming_the_field(base, body, param):
    assert_error(*call(base, "/v1/chat/completions", {"model": NAME, **body}), 400, param)


NOT_JSON = [b"{not json", b"[1, 2]", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', b"\xff",
            b"[" * 3000 + b"]" * 3000]  # nested past the parser's depth: a 400, not a 500


@pytest.mark.parametrize("raw", NOT_JSON)
def test_malformed_json_is_400(base, raw):
    assert_error(*call(base, "/v1/completions", raw=raw), 400, None)


def test_an_unknown_model_is_404(base, client):
    assert_error(*call(base, "/v1/completions", {"model": "gpt-5", "prompt": "x"}), 404, "model")
    assert_error(*call(base, "/v1/models/gpt-5"), 404, "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])
    status, body = call(base, "/v1/nowhere")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}


def test_a_body_over_the_limit_is_413(base):
    status, body = call(base, "/v1/completions", {"model": NAME, "prompt": "x" * (BODY_LIMIT + 1)})
    assert_error(status, body, 413, None)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [NAME]


def test_the_models_card_shows_the_context_and_the_default_max_tokens(base):
    status, body = call(base, "/v1/models")
    card = body["data"][0]
    assert status == 200 and card["max_model_len"] == 512 and card["default_max_tokens"] == DEFAULT_MAX_TOKENS


def test_a_request_without_max_tokens_gets_the_operators_cap(engine):
    """OpenAI's chat default is the room left in the context (here 500 tokens and more); the
    server's --default-max-tokens caps it, and a completion's default of 16, for requests that
    set no max_tokens; one that sets it gets what it asked."""
    app = create_app(engine, lambda: Scheduler(engine.model, engine.drafter), ServeOptions(NAME, default_max_tokens=5))
    server, thread, url = start_server(app)
    try:
        assert call(url, "/v1/models", key=None)[1]["data"][0]["default_max_tokens"] == 5
        chat = {"model": NAME, "messages": [{"role": "user", "content": PROMPTS[1]}], "ignore_eos": True}
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"model": NAME, "prompt": PROMPTS[0],
                                                                                  "ignore_eos": True})):
            status, answer = call(url, path, body, key=None)
            assert status == 200 and answer["usage"]["completion_tokens"] == 5, answer
            assert answer["choices"][0]["finish_reason"] == "length"
            status, answer = call(url, path, {**body, "max_tokens": 7}, key=None)
            assert status == 200 and answer["usage"]["completion_tokens"] == 7
    finally:
        stop_server(server, thread)


def test_the_default_max_tokens_must_be_positive():
    with pytest.raises(ValueError, match="default_max_tokens must be an integer >= 1"):
        ServeOptions(NAME, default_max_tokens=0)


@pytest.mark.parametrize("include_usage", [True, False])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_event(engine, base, include_usage):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every event carries its
    choice's usage so far (prompt, tokens generated); without include_usage it adds nothing, as in vLLM."""
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": NEW, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": include_usage, "continuous_usage_stats": True}}
    status, text = call(base, "/v1/chat/completions", body)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert status == 200 and len(events) > 3
    if not include_usage:
        assert all("usage" not in event for event in events)
        return
    prompt = engine.encode_chat(body["messages"]).shape[1]
    *choices, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0
    generated = [event["usage"]["completion_tokens"] for event in choices]
    assert generated[0] == 0 and generated == sorted(generated) and generated[-1] == last["usage"]["completion_tokens"]
    for event in events:
        usage = event["usage"]
        assert usage["prompt_tokens"] == prompt and usage["total_tokens"] == prompt + usage["completion_tokens"]


# ---- a client that leaves -----------------------------------------------------------------------
def test_a_client_leaving_mid_stream_cancels_its_row_and_the_next_request_is_served(engine, base):
    before = metrics(base).get("hasten_rows_finished_total{reason=cancelled}", 0.0)
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 1.0, "seed": 3, "stream": True}
    PacedScheduler.PACE["seconds"] = 0.02  # 400 tokens then take seconds: the row is surely running when we leave
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the stream has begun
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        deadline = time.monotonic() + 20
        while metrics(base).get("hasten_rows_finished_total{reason=cancelled}", 0.0) == before:
            assert time.monotonic() < deadline, "the row of the client that left was never cancelled"
            time.sleep(0.05)
    finally:
        PacedScheduler.PACE["seconds"] = 0.0
    status, answer = call(base, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": NEW,
                                                     "temperature": 0})
    assert status == 200 and answer["choices"][0]["text"] == reference(engine, PROMPTS[0]).text


# ---- metrics ----------------------------------------------------------------------------------------
def test_metrics_parse_and_move(base, client):
    before = metrics(base)
    client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    after = metrics(base)
    moved = ["hasten_requests_total{code=200,route=/v1/completions}", "hasten_prompt_tokens_total{}",
             "hasten_generated_tokens_total{}", "hasten_steps_total{}", "hasten_tau_count{}",
             "hasten_queue_seconds_count{}", "hasten_step_batch_size_count{}",
             "hasten_drafted_at_position_total{position=1}", "hasten_step_draft_seconds_sum{}",
             "hasten_step_verify_seconds_sum{}", "hasten_step_seconds_sum{}"]
    for name in moved:
        assert after[name] > before.get(name, 0.0), name
    assert after["hasten_generated_tokens_total{}"] - before["hasten_generated_tokens_total{}"] == NEW
    for name in ("hasten_running_rows{}", "hasten_waiting_rows{}"):
        assert name in after
    # the latencies a client waits for: one first token, one whole answer, NEW - 1 tokens after the first
    count = lambda name: after[name] - before.get(name, 0.0)  # noqa: E731
    assert count("hasten_time_to_first_token_seconds_count{}") == 1
    assert count("hasten_request_seconds_count{}") == 1
    assert count("hasten_inter_token_seconds_count{}") == NEW - 1
    assert count("hasten_time_to_first_token_seconds_sum{}") <= count("hasten_request_seconds_sum{}")


def test_a_request_can_turn_drafting_off_and_sees_its_own_acceptance(engine, client, base):
    """speculate=false (a body field, hasten's) decodes that request plainly, the same text;
    each answer carries its own drafted and accepted tokens, and /metrics counts them."""
    before = metrics(base)
    drafted = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    plain = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                      extra_body={"speculate": False})
    after = metrics(base)
    assert plain.choices[0].text == drafted.choices[0].text == reference(engine, PROMPTS[0]).text
    ours, theirs = drafted.model_extra["hasten"], plain.model_extra["hasten"]
    assert ours["speculated"] and ours["drafted_tokens"] > 0 and 0 < ours["accepted_tokens"] <= ours["drafted_tokens"]
    assert ours["steps"] < NEW and ours["tau"] > 1
    assert not theirs["speculated"] and theirs["drafted_tokens"] == theirs["accepted_tokens"] == 0
    assert theirs["steps"] == NEW and theirs["tau"] == 1.0 and theirs["acceptance_by_position"] == []
    count = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    assert count("hasten_drafted_tokens_total{}") == ours["drafted_tokens"]
    assert count("hasten_accepted_tokens_total{}") == ours["accepted_tokens"]
    assert count("hasten_rows_speculating_total{speculated=true}") == 1
    assert count("hasten_rows_speculating_total{speculated=false}") == 1
    assert after["hasten_kv_cache_bytes{}"] > 0
    status, body = call(base, "/v1/completions", {"model": NAME, "prompt": "x", "speculate": "no"})
    assert_error(status, body, 400, "speculate")


def test_latency_shares_are_exact():
    from hasten.serve.metrics import Metrics

    m = Metrics()
    m.tokens_arrived(3, 0.5, None)  # the first token after 0.5 s, two more with it
    m.tokens_arrived(2, 0.9, 0.4)  # two more 0.4 s later: 0.2 s each
    samples = {s.name: s.value for family in m.registry.collect() for s in family.samples if not s.labels or
               set(s.labels) == {"le"} and s.labels["le"] == "+Inf"}
    assert samples["hasten_time_to_first_token_seconds_sum"] == 0.5
    assert samples["hasten_inter_token_seconds_count"] == 4
    assert samples["hasten_inter_token_seconds_sum"] == pytest.approx(0.4)


# ---- a failing step --------------------------------------------------------------------------------
class FailingOnce(Scheduler):
    failures = [1]

    def step(self):
        if self.failures and self.running:
            self.failures.pop()
            raise RuntimeError("planted failure")
        return super().step()


POISON = [5, 6, 93, 7]  # a prompt no other test request starts with


class Poisoned(PacedScheduler):
    """The real (paced) scheduler, but admitting a prompt that starts with POISON raises: one
    bad row makes the step of every row beside it fail."""

    def _start(self, request, queued_seconds, reserved):
        if request.input_ids[: len(POISON)] == POISON:
            raise RuntimeError("planted failure")
        return super()._start(request, queued_seconds, reserved)


def test_a_passing_failure_is_survived_and_the_server_goes_on(engine):
    app = create_app(engine, lambda: FailingOnce(engine.model, engine.drafter, max_tokens_in_flight=100),
                     ServeOptions(NAME))
    server, thread, url = start_server(app)
    try:
        # no API key on this server; a request that alone needs more than --max-tokens-in-flight is refused
        status, body = call(url, "/v1/completions", {"model": NAME, "prompt": [5] * 90, "max_tokens": 11}, key=None)
        assert_error(status, body, 400, "max_tokens")
        assert "max_tokens (11)" in body["error"]["message"] and body["error"]["code"] == "over_capacity"
        # the step fails once; the row does not fail alone, so it moves to a fresh scheduler and ends as it would
        status, body = call(url, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": NEW,
                                                     "temperature": 0}, key=None)
        assert status == 200 and body["choices"][0]["text"] == reference(engine, PROMPTS[0]).text
        assert call(url, "/health", key=None)[0] == 200
    finally:
        stop_server(server, thread)


def test_a_row_that_breaks_the_step_fails_alone(engine):
    """Seven rows decode while a poisoned one arrives: it gets the error, each of the seven
    ends with exactly its single-request text, and the server serves the next request."""
    app = create_app(engine, lambda: Poisoned(engine.model, engine.drafter, max_batch=MAX_BATCH), ServeOptions(NAME))
    server, thread, url = start_server(app)
    normal = [{"model": NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 30, "temperature": 0}
              for i in range(7)]
    poisoned = {"model": NAME, "prompt": POISON, "max_tokens": 30, "temperature": 0}
    expected = [reference(engine, body["prompt"], 30).text for body in normal]
    PacedScheduler.PACE["seconds"] = 0.02  # the seven are still decoding when the poisoned row is admitted
    try:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(call, url, "/v1/completions", body, None) for body in normal]
            time.sleep(0.3)
            bad = pool.submit(call, url, "/v1/completions", poisoned, None)
            results = [answer.result() for answer in answers]
            status, body = bad.result()
        assert status == 500 and "planted failure" in body["error"]["message"]
        assert [(code, answer["choices"][0]["text"]) for code, answer in results] == [(200, text) for text in expected]
        status, body = call(url, "/v1/completions", normal[0], key=None)
        assert status == 200 and body["choices"][0]["text"] == expected[0]
    finally:
        PacedScheduler.PACE["seconds"] = 0.0
        stop_server(server, thread)


# ---- the command line ---------------------------------------------------------------------------------
def test_serve_flags_and_defaults(cli):
    from hasten.cli import build_parser

    code, out, _ = cli("serve", "--help")
    assert code == 0
    for flag in ("--host", "--port", "--api-key", "--max-batch", "--max-tokens-in-flight", "--method-arg", "--draft"):
        assert flag in out
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.host == "127.0.0.1" and args.max_batch == 32 and args.max_tokens_in_flight is None
    assert "--default-max-tokens" in out and args.default_max_tokens == DEFAULT_MAX_TOKENS == 512


@pytest.mark.parametrize("args, match", [
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--max-tokens-in-flight", "0"], "--max-tokens-in-flight must be >= 1"),
    (["--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
    (["--threads", "-1"], "--threads must be >= 0"),
    (["--port", "70000"], "--port must be in"),
    (["--method", "prompt_lookup", "--method-arg", "num_tokens=zero"], "num_tokens"),
    (["--method", "default", "--method-arg", "num_tokens=3"], "belong to a named method"),
    (["--method", "draft_model"], "needs a draft model"),
])
def test_serve_errors_are_one_line_before_loading(cli, args, match):
    code, _, err = cli("serve", "--model", "/nonexistent", *args)
    assert code == 2 and match in err and err.count("\n") == 1


def test_a_missing_extra_names_the_install_command(cli, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    code, _, err = cli("serve", "--model", "m")
    assert code == 2 and "pip install 'hasten[serve]'" in err and err.count("\n") == 1


def test_serve_builds_the_app_from_its_flags(tmp_path, cli, monkeypatch):
    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    path = save_checkpoint(tmp_path / "ckpt")
    code, _, err = cli("serve", "--model", path, "--method", "prompt_lookup", "--method-arg", "num_tokens=3",
                       "--api-key", KEY, "--max-batch", "3", "--max-tokens-in-flight", "400")
    assert code == 0, err
    assert seen["host"] == "127.0.0.1" and seen["port"] == 8000
    service = seen["app"].state.service
    assert service.options.api_key == KEY and service.options.model_name == path
    scheduler = service.worker.scheduler
    assert scheduler.max_batch == 3 and scheduler.max_tokens_in_flight == 400
    assert service.engine.drafter.settings.num_tokens == 3


def test_serve_bench_reports_every_level(base, cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:3]))
    out = tmp_path / "load.json"
    code, table, err = cli("serve-bench", "--url", f"{base}/v1", "--api-key", KEY, "--concurrency", "1,3",
                           "--requests", "3", "--max-tokens", "8", "--prompts", str(prompts), "--out", str(out))
    assert code == 0, err
    results = json.loads(out.read_text())
    assert results["model"] == NAME and results["method"] == "prompt_lookup"
    assert [level["concurrency"] for level in results["levels"]] == [1, 3]
    for level in results["levels"]:
        assert level["errors"] == 0 and level["requests"] == 3 and level["output_tokens"] > 0
        assert level["ttft_seconds"]["p50"] is not None and level["mean_tau"] >= 1.0
        # the three latencies a client waits for: first token <= the whole answer, per request
        assert level["ttft_seconds"]["p50"] <= level["latency_seconds"]["p50"] and level["itl_seconds"]["p50"] > 0
    assert "TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | end-to-end p50/p90/p99 ms" in table
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 1", "| 3"]  # one table row per level
    assert all(len(row.split(" | ")) == 8 for row in rows)  # every column filled


def test_serve_bench_compares_servers_level_by_level_and_draws_them(base, cli, tmp_path):
    """Two servers (here the same one under two names): every level of each, each answer
    compared with the first server's, and a chart of throughput against clients."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS[:2]))
    out, chart = tmp_path / "load.json", tmp_path / "load.png"
    code, table, err = cli("serve-bench", "--url", f"first={base}/v1", "--url", f"second={base}/v1", "--api-key", KEY,
                           "--concurrency", "1,2", "--requests", "2", "--max-tokens", "6", "--prompts", str(prompts),
                           "--out", str(out), "--chart", str(chart))
    assert code == 0, err
    results = json.loads(out.read_text())
    assert [(lv["server"], lv["concurrency"]) for lv in results["levels"]] == [
        ("first", 1), ("second", 1), ("first", 2), ("second", 2)]
    assert all(lv["identical"] == lv["compared"] == 2 for lv in results["levels"])  # greedy: the same answers
    assert "answers equal to first's" in table and "| second | 2 |" in table
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_bench_without_a_server_is_one_line(cli, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}))
    code, _, err = cli("serve-bench", "--url", f"http://127.0.0.1:{free_port()}/v1", "--prompts", str(prompts))
    assert code == 2 and "cannot reach a server" in err and err.count("\n") == 1


def test_the_builtin_load_prompts_end_at_a_function_signature():
    from hasten.bench.serve_load import builtin_prompts

    prompts = builtin_prompts(3)
    assert len(prompts) == 3 and len(set(prompts)) == 3
    assert all(p.endswith("\n") and p.splitlines()[-1].startswith("def ") for p in prompts)


@pytest.mark.parametrize("choices", [1, 3])
def test_a_non_streamed_client_leaving_while_its_row_decodes_cancels_the_row(engine, base, choices):
    """The row decodes steadily (an update every step), so only a check that does not wait
    for a quiet moment notices the client is gone; with n choices, every one of its rows ends."""
    before = metrics(base).get("hasten_rows_finished_total{reason=cancelled}", 0.0)
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 1.0, "seed": 3, "n": choices}
    PacedScheduler.PACE["seconds"] = 0.02  # 400 tokens take seconds, and the row sends an update every step
    try:
        connection.request("POST", "/v1/completions", json.dumps(body),
                           {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        time.sleep(1.0)  # the row is decoding
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
        left = time.monotonic()
        while metrics(base).get("hasten_rows_finished_total{reason=cancelled}", 0.0) < before + choices:
            assert time.monotonic() - left < 5, "a row of the client that left kept decoding"
            time.sleep(0.05)
    finally:
        PacedScheduler.PACE["seconds"] = 0.0
    assert metrics(base).get("hasten_running_rows", 0.0) == 0.0


def test_a_seed_holds_beside_neighbours_with_the_default_sizing(engine, monkeypatch, tmp_path):
    """The server's default draft sizing (unset: auto, but fixed for a seeded sampled row):
    the same seeded request gives the same text alone and beside seven unseeded neighbours.
    A steep cost curve (given, not timed) makes auto sizing choose depths by the batch, so a
    seeded row sized by it would draw differently beside neighbours."""
    from hasten.engine import calibration

    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "_MEMO", {})
    monkeypatch.setattr(calibration, "calibrate", lambda model: calibration.CostCurve(
        (1, 2, 4, 8, 16, 32, 64), (1.0, 1.1, 1.4, 2.5, 5.0, 10.0, 20.0)))
    app = create_app(engine, lambda: Scheduler(engine.runtime, engine.drafter, max_batch=8, draft_size=None),
                     ServeOptions(NAME))
    server, thread, url = start_server(app)
    seeded = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    neighbours = [{"model": NAME, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "temperature": 0.8}
                  for i in range(7)]
    try:
        from concurrent.futures import ThreadPoolExecutor

        status, alone = call(url, "/v1/completions", seeded, None)
        assert status == 200
        with ThreadPoolExecutor(8) as pool:
            crowd = [pool.submit(call, url, "/v1/completions", body, None) for body in neighbours]
            beside = pool.submit(call, url, "/v1/completions", seeded, None)
            assert all(answer.result()[0] == 200 for answer in crowd)
            status, answer = beside.result()
        assert status == 200 and answer["choices"][0]["text"] == alone["choices"][0]["text"]
        assert alone["choices"][0]["text"] == engine.generate(PROMPTS[3], max_new_tokens=24, temperature=1.0,
                                                              top_p=0.9, seed=7).text
    finally:
        stop_server(server, thread)


@pytest.mark.parametrize("extra", [{"logprobs": False}, {"suffix": ""}, {"repetition_penalty": 1.0}, {"min_p": 0},
                                   {"min_tokens": 0}, {"ignore_eos": False}, {"stop_token_ids": []},
                                   {"presence_penalty": 0, "frequency_penalty": 0.0}, {"logit_bias": {}},
                                   {"allowed_token_ids": None},
                                   {"response_format": {"type": "text"}}, {"tool_choice": "none"}])
def test_fields_at_their_neutral_values_are_accepted(engine, base, extra):
    status, body = call(base, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6,
                                                   "temperature": 0, **extra})
    assert status == 200 and body["choices"][0]["text"] == reference(engine, PROMPTS[0], 6).text


def test_a_prompt_is_tokenized_off_the_event_loop_with_a_tokenizer_of_its_own(engine):
    """While one request's prompt is being tokenized (held here until released), the server
    answers /health and serves a token-id request; then the held one ends with its right text."""
    app = create_app(engine, lambda: PacedScheduler(engine.model, engine.drafter, max_batch=MAX_BATCH),
                     ServeOptions(NAME, KEY, BODY_LIMIT))
    encoder = app.state.service.encode
    assert encoder.engine.tokenizer is not engine.tokenizer and encoder.engine.model is engine.model
    held, release, threads = threading.Event(), threading.Event(), []

    class Holding:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def __call__(self, *args, **kwargs):
            threads.append(threading.current_thread().name)
            held.set()
            assert release.wait(30)
            return self.tokenizer(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.tokenizer, name)

    encoder.engine.tokenizer = Holding(encoder.engine.tokenizer)
    server, thread, url = start_server(app)
    try:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(call, url, "/v1/completions",
                               {"model": NAME, "prompt": PROMPTS[0], "max_tokens": NEW, "temperature": 0})
            assert held.wait(30)
            assert call(url, "/health", method="GET")[0] == 200
            ids = engine.encode(PROMPTS[1])[0].tolist()
            status, body = call(url, "/v1/completions", {"model": NAME, "prompt": ids, "max_tokens": NEW, "temperature": 0})
            assert status == 200 and body["choices"][0]["text"] == reference(engine, PROMPTS[1]).text
            assert not slow.done()  # still held: the other requests did not wait for it
            release.set()
            status, body = slow.result(60)
        assert status == 200 and body["choices"][0]["text"] == reference(engine, PROMPTS[0]).text
        assert threads and all(name.startswith("hasten-encode") for name in threads)
    finally:
        release.set()
        stop_server(server, thread)


def test_a_request_the_fixed_kv_cache_cannot_hold_alone_is_a_400_naming_the_flag(engine):
    """``--kv-cache-mib``: a request whose prompt and max_tokens need more KV entries than the
    whole store holds is refused at admission, naming the flag; one that fits is served."""
    from hasten.serve.app import scheduler_factory

    entry_bytes = Scheduler(engine.model, engine.drafter, max_batch=1, kv_cache_bytes=1).target.arena.entry_bytes
    app = create_app(engine, scheduler_factory(engine, max_batch=2, kv_cache_bytes=120 * entry_bytes),
                     ServeOptions(NAME))
    server, thread, url = start_server(app)
    try:
        status, body = call(url, "/v1/completions", {"model": NAME, "prompt": [5] * 90, "max_tokens": 20}, key=None)
        assert_error(status, body, 400, "max_tokens")
        assert "--kv-cache-mib" in body["error"]["message"] and body["error"]["code"] == "over_capacity"
        status, body = call(url, "/v1/completions", {"model": NAME, "prompt": [5] * 20, "max_tokens": 8,
                                                     "temperature": 0}, key=None)
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    finally:
        stop_server(server, thread)
