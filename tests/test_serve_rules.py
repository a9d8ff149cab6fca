"""``hasten serve`` honours the fields that transform the target distribution: OpenAI's
presence_penalty, frequency_penalty and logit_bias, vLLM's min_p, repetition_penalty,
allowed_token_ids, min_tokens, stop_token_ids, ignore_eos and include_stop_str_in_output (sent by the official ``openai``
client, vLLM's through ``extra_body``). A greedy answer equals ``Engine.generate`` with the same
rules (whose equality with plain decoding under them test_logit_rules.py checks), with prompt
lookup drafting; out-of-range values are 400s naming the field (test_serve.BAD_BODIES).
"""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")
pytest.importorskip("uvicorn", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")

from hasten.engine.stops import TextStream  # noqa: E402
from helpers import tiny_tokenizer  # noqa: E402
from test_serve import NAME, assert_error, base, call, client, engine  # noqa: E402,F401

PROMPT = "def add(a, b):\n    return a + b\n" * 3
NEW = 20
EOS = 2

# (the client's keyword arguments, the rules hasten.generate takes)
FIELDS = {
    "presence_frequency": (dict(presence_penalty=1.5, frequency_penalty=0.8),
                           dict(presence_penalty=1.5, frequency_penalty=0.8)),
    "logit_bias": (dict(logit_bias={"5": 4, "40": -100}), dict(logit_bias={5: 4.0, 40: -100.0})),
    "logit_bias_clamped": (dict(logit_bias={"5": 500}), dict(logit_bias={5: 100.0})),
    "repetition_penalty": (dict(extra_body={"repetition_penalty": 1.4}), dict(repetition_penalty=1.4)),
    "allowed_token_ids": (dict(extra_body={"allowed_token_ids": list(range(3, 50))}),
                          dict(allowed_token_ids=list(range(3, 50)))),
    "min_tokens": (dict(logit_bias={str(EOS): 8}, extra_body={"min_tokens": 6}),
                   dict(logit_bias={EOS: 8.0}, min_tokens=6)),
}


def expected(engine, rules: dict, **kwargs):
    return engine.generate(PROMPT, max_new_tokens=NEW, **rules, **kwargs)


@pytest.mark.parametrize("case", sorted(FIELDS))
def test_a_greedy_completion_under_a_field_is_the_engines_under_the_rule(engine, client, case):
    asked, rules = FIELDS[case]
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0, **asked)
    reference = expected(engine, rules)
    assert answer.choices[0].text == reference.text
    assert answer.usage.completion_tokens == len(reference.token_ids)
    assert reference.text != expected(engine, {}).text  # the field changed the answer
    if case == "min_tokens":  # EOS (pushed up by the bias) is held back for 6 tokens, then ends the answer
        assert len(reference.token_ids) == 7 and reference.token_ids[-1] == EOS
        assert answer.choices[0].finish_reason == "stop"


def test_chat_and_streams_honour_the_fields(engine, client):
    rules = dict(presence_penalty=1.2, repetition_penalty=1.3)
    messages = [{"role": "user", "content": PROMPT}]
    answer = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, temperature=0,
                                            presence_penalty=1.2, extra_body={"repetition_penalty": 1.3})
    assert answer.choices[0].message.content == engine.chat(messages, max_new_tokens=NEW, **rules).text
    stream = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0, stream=True,
                                       presence_penalty=1.2, extra_body={"repetition_penalty": 1.3})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected(engine, rules).text


def test_min_p_samples_within_the_kept_tokens(engine, client):
    """min_p 1 keeps only the best token: a sampled answer is the greedy one."""
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=1.0, seed=3,
                                       extra_body={"min_p": 1.0})
    assert answer.choices[0].text == expected(engine, {}).text


def test_stop_token_ids_end_the_answer_and_stay_out_of_its_text(engine, client):
    tokens = expected(engine, {}).token_ids
    stop = tokens[5]
    first = tokens.index(stop)
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                       extra_body={"stop_token_ids": [stop]})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == engine.tokenizer.decode(tokens[:first], skip_special_tokens=True)
    assert answer.usage.completion_tokens == first + 1  # the stop token is counted, as vLLM


def test_include_stop_str_in_output_keeps_the_stop_in_the_text(engine, client):
    tokens = expected(engine, {}).token_ids
    stop = tokens[5]
    first = tokens.index(stop)
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                       extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": True})
    assert answer.choices[0].text == engine.tokenizer.decode(tokens[: first + 1], skip_special_tokens=True)
    full = expected(engine, {}).text
    string = full[len(full) // 2: len(full) // 2 + 2]
    for stream in (False, True):
        answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0, stop=[string],
                                           stream=stream, extra_body={"include_stop_str_in_output": True})
        text = "".join(chunk.choices[0].text for chunk in answer if chunk.choices) if stream \
            else answer.choices[0].text
        assert text == full[: full.index(string) + len(string)]


def test_ignore_eos_decodes_past_eos(client):
    forced = dict(temperature=0, logit_bias={str(EOS): 100})  # EOS first, every time
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, **forced)
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == 1
    answer = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True},
                                       **forced)
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
    assert answer.choices[0].text == ""  # EOS is a special token


def test_a_bad_value_on_chat_is_400_naming_it(base):
    messages = [{"role": "user", "content": "def"}]
    for field, value in (("presence_penalty", 3), ("repetition_penalty", 0), ("min_p", 2), ("stop_token_ids", [-5]),
                         ("allowed_token_ids", [10**6])):
        assert_error(*call(base, "/v1/chat/completions", {"model": NAME, "messages": messages, field: value}), 400,
                     field)


def test_min_tokens_skips_stop_strings_in_its_first_tokens():
    """vLLM's rule: a stop string ending within the first min_tokens tokens' text is no stop."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer("def add(a, b):\n    return a + b\n" * 2).input_ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    early = sum(len(tokenizer.decode(ids[: i + 1])) < text.find("b)") + 2 for i in range(len(ids)))
    stream = TextStream(tokenizer, ["b)"], min_tokens=early + 1)
    shown = "".join(stream.push([t]) for t in ids) + stream.finish()
    second = text.find("b)", text.find("b)") + 1)
    assert stream.stopped and shown == text[:second]
    stream = TextStream(tokenizer, ["b)"])
    assert "".join(stream.push([t]) for t in ids) == text[: text.find("b)")]
