"""``hasten serve``'s log-probabilities (``logprobs``, chat's ``top_logprobs``, ``echo``,
``max_tokens: 0``, ``prompt_logprobs``) equal a plain forward of the target over the prompt and
the output, position by position, with prompt lookup accepting drafts two and more deep.

One server in this process (as in test_serve.py) over a tiny random Llama; the references
are ``Engine.generate`` / ``Engine.chat`` (the same tokens) and ``log_softmax`` of one plain
forward of the model.
"""
from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")
pytest.importorskip("uvicorn", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")

from hasten.api import Engine, make_drafter  # noqa: E402
from hasten.core.sampling import Sampling  # noqa: E402
from hasten.engine.batch import Scheduler  # noqa: E402
from hasten.engine.logprobs import MAX_TOP_LOGPROBS  # noqa: E402
from hasten.serve.app import ServeOptions, create_app  # noqa: E402
from helpers import tiny_model, tiny_tokenizer  # noqa: E402
from test_serve import KEY, NAME, TEMPLATE, assert_error, call, start_server, stop_server  # noqa: E402

NEW = 32
TOL = 1e-4  # batched forwards (padded blocks, tree masks) against one plain forward, in float32
PROMPTS = ["def add(a, b):\n    return a + b\n" * 3, "for i in range(10):\n    print(i)\n" * 3]
# a sampled request whose draws follow prompt lookup's drafts often enough to accept two and more deep
SAMPLED = dict(temperature=0.01, top_k=40, seed=0)


@pytest.fixture(scope="module")
def engine():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    # fixed draft sizes: the reference generations and the server's rows draft alike
    return Engine(tiny_model("llama"), tokenizer, make_drafter("prompt_lookup"), "prompt_lookup", draft_size="fixed")


@pytest.fixture(scope="module")
def base(engine):
    def make():
        return Scheduler(engine.model, engine.drafter, max_batch=4, draft_size=engine.draft_size)

    server, thread, url = start_server(create_app(engine, make, ServeOptions(NAME, KEY, 1 << 20)))
    yield url
    stop_server(server, thread)


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)


def plain(engine, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log_softmax of one plain forward: row i scores the token after ids[i]."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids], device=engine.model.device)).logits[0]
    return logits.float().log_softmax(-1).cpu()


def text_of(engine, token: int) -> str:
    return engine.tokenizer.decode([token])


def expected_top(engine, row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    top = row.topk(k)
    return list(zip(top.indices.tolist(), top.values.tolist()))


def check_completion_logprobs(engine, logprobs: dict, ids: list[int], start: int, reference: torch.Tensor,
                              k: int) -> None:
    """``logprobs`` (OpenAI's legacy object) over ``ids[start:]``, scored by the plain forward
    ``reference`` of ``ids``; its top_logprobs hold the k likeliest and the token itself."""
    tokens = ids[start:]
    assert logprobs["tokens"] == [text_of(engine, t) for t in tokens]
    offsets = [0]
    for t in tokens[:-1]:
        offsets.append(offsets[-1] + len(text_of(engine, t)))
    assert logprobs["text_offset"] == offsets
    for i, (token, got, top) in enumerate(zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"])):
        position = start + i
        if position == 0:  # an echoed prompt's first token has no context to be scored in
            assert got is None and top is None
            continue
        row = reference[position - 1]
        assert got == pytest.approx(row[token].item(), abs=TOL)
        wanted = {text_of(engine, t): lp for t, lp in expected_top(engine, row, k)}
        wanted.setdefault(text_of(engine, token), row[token].item())
        assert top.keys() == wanted.keys()
        assert list(top.values()) == pytest.approx(list(wanted.values()), abs=TOL)


def sampled_reference(engine, prompt: str, sampled: bool):
    return engine.generate(prompt, max_new_tokens=NEW, **(SAMPLED if sampled else {}))


# ---- generated tokens --------------------------------------------------------------------------------
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_logprobs_equal_a_plain_forward(engine, client, sampled, stream):
    prompt = PROMPTS[0]
    expected = sampled_reference(engine, prompt, sampled)
    k = 5
    options = SAMPLED if sampled else {"temperature": 0}
    extra = {"top_k": options["top_k"]} if sampled else None
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, logprobs=k, stream=stream,
                                       temperature=options["temperature"], seed=options.get("seed"), extra_body=extra)
    if stream:
        chunks = list(answer)
        text = "".join(c.choices[0].text for c in chunks)
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            if c.choices[0].logprobs is not None:
                for key in logprobs:
                    logprobs[key] += getattr(c.choices[0].logprobs, key)
        stats = chunks[-1].model_extra["hasten"]
    else:
        text, logprobs = answer.choices[0].text, answer.choices[0].logprobs.model_dump()
        stats = answer.model_extra["hasten"]
    assert text == expected.text  # asking for log-probabilities changes nothing that is emitted
    assert stats["acceptance_by_position"][1] > 0  # drafts were accepted two deep: scored by the verifying forward
    ids = engine.encode(prompt)[0].tolist() + expected.token_ids
    check_completion_logprobs(engine, logprobs, ids, len(ids) - len(expected.token_ids), plain(engine, ids), k)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_equal_a_plain_forward(engine, client, sampled, stream):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    expected = engine.chat(messages, max_new_tokens=NEW, **(SAMPLED if sampled else {}))
    options = SAMPLED if sampled else {"temperature": 0}
    k = 3
    answer = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=NEW, logprobs=True, top_logprobs=k, stream=stream,
        temperature=options["temperature"], seed=options.get("seed"),
        extra_body={"top_k": options["top_k"]} if sampled else None)
    if stream:
        chunks = list(answer)
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        content = [entry for c in chunks if c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
        stats = chunks[-1].model_extra["hasten"]
    else:
        text, content = answer.choices[0].message.content, answer.choices[0].logprobs.content
        stats = answer.model_extra["hasten"]
    assert text == expected.text
    assert stats["acceptance_by_position"][1] > 0
    prompt_ids = engine.encode_chat(messages)[0].tolist()
    reference = plain(engine, prompt_ids + expected.token_ids)
    assert len(content) == len(expected.token_ids)
    for i, (token, entry) in enumerate(zip(expected.token_ids, content)):
        row = reference[len(prompt_ids) - 1 + i]
        assert entry.token == text_of(engine, token) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(row[token].item(), abs=TOL)
        wanted = expected_top(engine, row, k)
        assert [alt.token for alt in entry.top_logprobs] == [text_of(engine, t) for t, _ in wanted]
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx([lp for _, lp in wanted], abs=TOL)


def test_without_logprobs_the_answer_says_null(client):
    answer = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert answer.choices[0].logprobs is None
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                            temperature=0, logprobs=False)
    assert answer.choices[0].logprobs is None


def test_logprobs_zero_scores_the_token_alone(engine, base):
    status, body = call(base, "/v1/completions", {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 6,
                                                   "temperature": 0, "logprobs": 0})
    assert status == 200
    logprobs = body["choices"][0]["logprobs"]
    assert [list(top) for top in logprobs["top_logprobs"]] == [[token] for token in logprobs["tokens"]]
    assert [list(top.values())[0] for top in logprobs["top_logprobs"]] == logprobs["token_logprobs"]


# ---- the prompt: echo, max_tokens 0, prompt_logprobs ----------------------------------------------------
def test_echo_with_max_tokens_0_scores_the_prompt(engine, client):
    """lm-eval's completions scoring: the prompt back, its tokens' log-probabilities, nothing new."""
    prompt = PROMPTS[1]
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = answer.choices[0]
    assert choice.text == prompt and answer.usage.completion_tokens == 0
    ids = engine.encode(prompt)[0].tolist()
    check_completion_logprobs(engine, choice.logprobs.model_dump(), ids, 0, plain(engine, ids), 2)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_puts_the_prompt_and_its_logprobs_before_the_output(engine, base, stream):
    prompt = PROMPTS[0]
    expected = engine.generate(prompt, max_new_tokens=8)
    ids = engine.encode(prompt)[0].tolist() + expected.token_ids
    status, body = call(base, "/v1/completions", {"model": NAME, "prompt": engine.encode(prompt)[0].tolist(),
                                                   "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 1,
                                                   "stream": stream})
    assert status == 200
    if stream:
        events = [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]
        text = "".join(e["choices"][0]["text"] for e in events)
        assert events[0]["choices"][0]["text"] == engine.tokenizer.decode(ids[: len(ids) - 8])  # the prompt first
        logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in events:
            for key in logprobs:
                logprobs[key] += (e["choices"][0]["logprobs"] or {}).get(key, [])
    else:
        text, logprobs = body["choices"][0]["text"], body["choices"][0]["logprobs"]
    assert text == engine.tokenizer.decode(ids[: len(ids) - 8]) + expected.text
    check_completion_logprobs(engine, logprobs, ids, 0, plain(engine, ids), 1)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_logprobs_are_vllms_per_prompt_token(engine, base, route):
    k = 2
    if route == "chat":
        messages = [{"role": "user", "content": PROMPTS[1]}]
        status, body = call(base, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 3,
                                                            "temperature": 0, "prompt_logprobs": k})
        ids, got = engine.encode_chat(messages)[0].tolist(), body["prompt_logprobs"]
    else:
        status, body = call(base, "/v1/completions", {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 3,
                                                       "temperature": 0, "prompt_logprobs": k})
        ids, got = engine.encode(PROMPTS[1])[0].tolist(), body["choices"][0]["prompt_logprobs"]
    assert status == 200
    reference = plain(engine, ids)
    assert len(got) == len(ids) and got[0] is None
    for position in range(1, len(ids)):
        row, token = reference[position - 1], ids[position]
        wanted = {t: lp for t, lp in expected_top(engine, row, k)}
        wanted.setdefault(token, row[token].item())
        entry = got[position]
        assert {int(t) for t in entry} == wanted.keys()
        for t, value in entry.items():
            assert value["logprob"] == pytest.approx(wanted[int(t)], abs=TOL)
            assert value["decoded_token"] == text_of(engine, int(t))
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1


# ---- limits ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route, extra, param", [
    ("completions", {"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"prompt_logprobs": MAX_TOP_LOGPROBS + 1}, "prompt_logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only scores a prompt, with echo
    ("chat", {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true, as OpenAI
    ("chat", {"logprobs": 3}, "logprobs"),  # chat's is true or false
    ("chat", {"echo": True}, "echo"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_logprob_fields_out_of_range_are_400_naming_the_field(base, route, extra, param):
    if route == "chat":
        body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], **extra}
        assert_error(*call(base, "/v1/chat/completions", body), 400, param)
    else:
        assert_error(*call(base, "/v1/completions", {"model": NAME, "prompt": "x", **extra}), 400, param)


def test_the_openai_client_sees_the_field_named(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="x", max_tokens=2, logprobs=MAX_TOP_LOGPROBS + 1)
    assert caught.value.body["param"] == "logprobs"


# ---- the scheduler: a tree's accepted path is scored at its own block positions ----------------------------
def test_a_tree_drafts_accepted_path_is_scored_where_the_verifier_read_it(engine):
    """Off the chain's block order: the right token is the last of three siblings at every
    level, so the accepted nodes (2, 5, 8, ...) are not the block's first positions."""
    from hasten.engine.batch import Request
    from helpers import TreeScriptedDrafter, hf_greedy

    prompt = engine.encode(PROMPTS[0])[0].tolist()
    reference = hf_greedy(engine.model, torch.tensor([prompt]), NEW)[0].tolist()
    drafter = TreeScriptedDrafter(reference, depth=4, width=3, right_sibling=2, error_at=3)
    scheduler = Scheduler(engine.model, drafter, max_batch=2, draft_size="fixed")
    row = scheduler.submit(Request(prompt, NEW, logprobs=4, prompt_logprobs=1))
    tokens, scored, prompt_scored = [], [], None
    with torch.no_grad():
        while scheduler.has_work():
            for update in scheduler.step():
                assert update.row_id == row and len(update.logprobs) == len(update.tokens)
                tokens += update.tokens
                scored += update.logprobs
                prompt_scored = update.prompt_logprobs if update.prompt_logprobs is not None else prompt_scored
                assert update.stats.acceptance_by_position[:3] == [1.0, 1.0, 1.0]  # three deep every step
    assert prompt + tokens == reference
    logp = plain(engine, reference)
    for i, entry in enumerate(scored):
        row_logp = logp[len(prompt) - 1 + i]
        assert entry.token == tokens[i] and entry.logprob == pytest.approx(row_logp[entry.token].item(), abs=TOL)
        assert [t for t, _ in entry.top] == row_logp.topk(4).indices.tolist()
        assert entry.rank == int((row_logp > row_logp[entry.token]).sum()) + 1
    assert [entry.token for entry in prompt_scored] == prompt[1:]
    assert [entry.logprob for entry in prompt_scored] == pytest.approx(
        logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist(), abs=TOL)


# ---- vLLM's own cases (tests/entrypoints/openai/completion/test_completion.py, chat_completion/test_chat.py) ----
PROMPT_IDS = [5, 6, 7, 8, 9]


def test_vllm_zero_and_some_logprobs(client):
    """test_no_logprobs, test_zero_logprobs, test_some_logprobs and their chat versions."""
    def completion(**extra):
        return client.completions.create(model=NAME, prompt=PROMPT_IDS, max_tokens=5, temperature=0, **extra).choices[0]

    assert completion(logprobs=None).logprobs is None
    assert len(completion(logprobs=0).logprobs.top_logprobs[0]) == 1
    assert 5 <= len(completion(logprobs=5).logprobs.top_logprobs[0]) <= 6
    messages = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "1+1?"}]

    def chat(**extra):
        return client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=5, temperature=0,
                                              **extra).choices[0]

    assert chat(logprobs=False).logprobs is None
    assert len(chat(logprobs=True, top_logprobs=0).logprobs.content[0].top_logprobs) == 0
    assert len(chat(logprobs=True, top_logprobs=5).logprobs.content[0].top_logprobs) == 5


def test_vllm_too_many_logprobs_and_the_server_goes_on(client):
    """test_too_many_completion_logprobs, test_too_many_chat_logprobs."""
    messages = [{"role": "user", "content": "1+1?"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt=PROMPT_IDS, max_tokens=5, logprobs=30, stream=stream)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=10, logprobs=True,
                                           top_logprobs=21, stream=stream)
    assert client.completions.create(model=NAME, prompt=PROMPT_IDS, max_tokens=5, temperature=0).choices[0].text


@pytest.mark.parametrize("count", [-1, 0, 1, None])
def test_vllm_prompt_logprobs_completion_and_chat(client, count):
    """test_prompt_logprobs_completion (two prompts, a choice each), test_prompt_logprobs_chat."""
    extra = {} if count is None else {"extra_body": {"prompt_logprobs": count}}
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Who won the world series in 2020?"}]
    if count is not None and count < 0:
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt=["def add(a, b):", "for i in"], max_tokens=2, **extra)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, **extra)
        return
    completion = client.completions.create(model=NAME, prompt=["def add(a, b):", "for i in"], max_tokens=2, **extra)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, **extra)
    for got in (completion.choices[0].prompt_logprobs, completion.choices[1].prompt_logprobs, chat.prompt_logprobs):
        assert got is None if count is None else len(got) > 0


def test_vllm_more_than_one_prompt_logprobs_chat(engine, client):
    """test_more_than_one_prompt_logprobs_chat: k alternatives, plus the prompt token when it is not among them."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    ids = engine.encode_chat(messages)[0].tolist()
    reference = plain(engine, ids)
    for k in (1, 2):
        got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2,
                                             extra_body={"prompt_logprobs": k}).prompt_logprobs
        for position in range(1, len(ids)):
            in_top = ids[position] in reference[position - 1].topk(k).indices.tolist()
            assert len(got[position]) == (k if in_top else k + 1)


@pytest.mark.parametrize("k", [1, 0])
@pytest.mark.parametrize("prompt", ["def add(a, b):", PROMPT_IDS], ids=["text", "ids"])
def test_vllm_echo_logprob_completion(engine, client, k, prompt):
    """test_echo_logprob_completion."""
    completion = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                           logprobs=k)
    prompt_text = engine.tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
    assert completion.choices[0].text.startswith(prompt_text)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.text_offset) > 5 and len(logprobs.tokens) > 5
    assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
    assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
    assert all(max(k, 1) <= len(top) <= k + 1 for top in logprobs.top_logprobs[1:])


def test_streamed_text_offsets_equal_the_whole_answers_with_a_stop_string(base):
    """vLLM's test_stream_text_offset_matches_non_stream_with_stop_holdback: a stream holds
    back text that may become a stop string, but every token's log-probability and offset
    still arrive, the same as in the whole answer."""
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0, "logprobs": 2,
            "stop": ["&:$o 3"]}  # the output begins "$o&:$o&:$o 3": "&:$o" is held back twice, then stops it
    status, whole = call(base, "/v1/completions", body)
    assert status == 200 and whole["choices"][0]["text"] == "$o&:$o" and whole["choices"][0]["finish_reason"] == "stop"
    status, text = call(base, "/v1/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    streamed = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for event in events:
        for key in streamed:
            streamed[key] += (event["choices"][0]["logprobs"] or {}).get(key, [])
    assert streamed == whole["choices"][0]["logprobs"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]


def test_rows_are_scored_alike_in_slices(monkeypatch):
    """A long prompt is scored ROWS_AT_ONCE rows at a time: the same entries as all at once."""
    from hasten.engine import logprobs

    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))  # [rows, vocab]
    tokens = [3, 14, 15, 9, 2, 6, 5]
    whole = logprobs.token_logprobs(logits, tokens, 4)
    monkeypatch.setattr(logprobs, "ROWS_AT_ONCE", 3)
    assert logprobs.token_logprobs(logits, tokens, 4) == whole
    expected = logits.log_softmax(-1)
    assert [entry.logprob for entry in whole] == pytest.approx(expected[torch.arange(7), tokens].tolist(), abs=1e-6)
    assert [entry.rank for entry in whole] == [int((row > row[t]).sum()) + 1 for row, t in zip(expected, tokens)]


def test_logprobs_mode_processed_reports_the_law_each_token_was_drawn_from(engine):
    """`hasten serve --logprobs-mode processed`: a sampled request's log-probabilities are those of
    its temperature and top-k law (top-k 5: alternatives past the fifth have none); the text is
    what the same request draws without scoring."""
    def make():
        return Scheduler(engine.model, engine.drafter, max_batch=2, draft_size=engine.draft_size)

    server, thread, url = start_server(create_app(engine, make, ServeOptions(NAME, KEY, 1 << 20, "processed")))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        answer = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, logprobs=6,
                                           temperature=SAMPLED["temperature"], seed=SAMPLED["seed"],
                                           extra_body={"top_k": 5})
    finally:
        stop_server(server, thread)
    expected = engine.generate(PROMPTS[0], max_new_tokens=NEW, temperature=SAMPLED["temperature"], top_k=5,
                               seed=SAMPLED["seed"])
    choice = answer.choices[0]
    assert choice.text == expected.text
    ids = engine.encode(PROMPTS[0])[0].tolist() + expected.token_ids
    start = len(ids) - len(expected.token_ids)
    with torch.no_grad():
        logits = engine.model(torch.tensor([ids], device=engine.model.device)).logits[0].float().cpu()
    law = Sampling(SAMPLED["temperature"], top_k=5).probs(logits).log()  # [len(ids), vocab]
    for i, (logprob, top) in enumerate(zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs)):
        assert logprob == pytest.approx(law[start + i - 1, ids[start + i]].item(), abs=TOL)
        assert sum(value == -9999.0 for value in top.values()) == 1  # 6 asked, 5 with mass: -inf shows as vLLM's -9999
