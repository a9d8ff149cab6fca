"""Tools as agents send them (``tool_choice: "auto"``, the default with tools) and chat roles as vLLM
renders them, through ``hasten serve`` and the official openai client.

The tiny random model writes a call when the request's ``logit_bias`` favours the format's trigger token
(and EOS, so it stops after the call): from the trigger on, the grammar writes a call of one of the
tools with arguments valid for it, whatever the model prefers. Two tokenizers: one where ``<tool_call>``
is an ordinary token of text (SmolLM2's case: a lazy lexeme ends the free text there) and one where it
is an added token (Qwen2.5's case: the grammar names it as a token)."""
from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from hasten.api import Engine, make_drafter  # noqa: E402
from hasten.engine.batch import Scheduler  # noqa: E402
from hasten.serve.app import ServeOptions, create_app  # noqa: E402
from hasten.serve.chat import ChatTemplate  # noqa: E402
from hasten.serve.tool_parsers import FORMATS, ToolStream  # noqa: E402
from hasten.structured import Grammar  # noqa: E402
from helpers import ScriptedDrafter, _byte_chars, tiny_model  # noqa: E402
from test_serve import TEMPLATE, assert_error, call, start_server, stop_server  # noqa: E402

NAME = "tiny-tools"
NEW = 48
HERMES = FORMATS["hermes"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
FUNCTIONS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "what is the weather in paris?"}]
# a template that shows tools and tool calls itself, as Qwen2.5's does (in its own words)
TOOLS_TEMPLATE = (
    "{% if tools %}system: tools {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}{% if m.get('tool_call_id') %} (id {{ m.tool_call_id }}){% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def tool_tokenizer(added_markers: bool, template: str):
    """A byte-level BPE over printable ASCII that merges across word boundaries, so ``<tool_call>`` is
    one token of text; ``added_markers``: ``<tool_call>`` and ``</tool_call>`` are added tokens instead."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_char = _byte_chars()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted({byte_char[b] for b in range(32, 127)} | {byte_char[10]})
    text = [HERMES.system_text(TOOLS), HERMES.call_text("add", {"a": 1, "b": 2}), MESSAGES[0]["content"]] * 10
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"],
                                                      initial_alphabet=alphabet))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    if added_markers:
        tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in ("<tool_call>", "</tool_call>")])
    tokenizer.chat_template = template
    return tokenizer


def trigger_bias(tokenizer) -> dict[str, int]:
    """logit_bias that makes the random model open a call at once and end after it."""
    (trigger,) = tokenizer.encode("<tool_call>")
    return {str(trigger): 100, str(tokenizer.eos_token_id): 50}


def make_engine(added_markers: bool, template: str, method: str = "prompt_lookup", drafter=None) -> Engine:
    tokenizer = tool_tokenizer(added_markers, template)
    model = tiny_model("llama", vocab_size=len(tokenizer))
    drafter = drafter if drafter is not None else make_drafter(method)
    return Engine(model, tokenizer, drafter, method, draft_size="fixed")


@pytest.fixture(scope="module", params=["text_trigger", "added_token_trigger"])
def served(request):
    """(engine, base url) of a server whose tokenizer writes the trigger as text (its template shows no
    tools: hasten writes them into the system turn) or as an added token (its template shows them)."""
    added = request.param == "added_token_trigger"
    engine = make_engine(added, TOOLS_TEMPLATE if added else TEMPLATE)
    app = create_app(engine, lambda: Scheduler(engine.model, engine.drafter, max_batch=4, draft_size="fixed"),
                     ServeOptions(NAME))
    server, thread, url = start_server(app)
    yield engine, url
    stop_server(server, thread)


def client_of(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def assert_valid_call(name: str, arguments: str) -> None:
    """The arguments are JSON valid for the tool's schema (the schemas here: required keys only,
    bounded strings and integers)."""
    schema, values = FUNCTIONS[name], json.loads(arguments)
    assert set(values) == set(schema["required"])
    for key, value in values.items():
        rule = schema["properties"][key]
        if rule["type"] == "string":
            assert isinstance(value, str) and len(value) <= rule["maxLength"]
        else:
            assert isinstance(value, int) and rule["minimum"] <= value <= rule["maximum"]


def test_auto_tool_calls_through_the_openai_client(served):
    engine, url = served
    client = client_of(url)
    bias = trigger_bias(engine.tokenizer)
    answer = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=NEW, temperature=0,
                                            logit_bias=bias, parallel_tool_calls=False)  # no tool_choice: auto
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (made,) = choice.message.tool_calls
    assert made.type == "function" and made.id.startswith("call_")
    assert_valid_call(made.function.name, made.function.arguments)

    stream = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=NEW, temperature=0,
                                            logit_bias=bias, tool_choice="auto", stream=True,
                                            parallel_tool_calls=False)
    names, arguments, reasons = {}, {}, []
    for event in stream:
        for c in event.choices:
            reasons.append(c.finish_reason)
            for delta in c.delta.tool_calls or []:
                if delta.function.name:
                    names[delta.index] = delta.function.name
                arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert reasons[-1] == "tool_calls"
    assert names == {0: made.function.name} and arguments == {0: made.function.arguments}


def test_without_the_trigger_the_answer_is_free_text(served):
    engine, url = served
    answer = client_of(url).chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=12,
                                                    temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")


def test_speculation_answers_as_plain_decoding_with_tools_in_auto_mode(served):
    """The default method's greedy answers equal plain decoding's (speculate false), calls and free
    text, parallel calls allowed or not, the trigger strongly or mildly favoured."""
    engine, url = served
    bias = trigger_bias(engine.tokenizer)
    for fields in ({"logit_bias": bias}, {}, {"logit_bias": bias, "parallel_tool_calls": False},
                   {"logit_bias": {next(iter(bias)): 3}}):
        body = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": NEW, "temperature": 0, **fields}
        status, fast = call(url, "/v1/chat/completions", body, key=None)
        status_plain, plain = call(url, "/v1/chat/completions", {**body, "speculate": False}, key=None)
        assert status == status_plain == 200, (fast, plain)
        strip = [{**c["message"], "tool_calls": [c_["function"] for c_ in c["message"].get("tool_calls") or []]}
                 for c in (fast["choices"][0], plain["choices"][0])]
        assert strip[0] == strip[1]
        assert fast["usage"] == plain["usage"]


def test_a_malformed_call_cannot_follow_the_trigger(served):
    """Sampled hot, with the trigger favoured: every answer that wrote the trigger is complete calls
    (or a call cut by max_tokens), never JSON the parser cannot read; and the compiled grammar refuses
    text after the trigger that is not a call."""
    engine, url = served
    bias = {next(iter(trigger_bias(engine.tokenizer))): 4}
    for seed in range(6):
        body = {"model": NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": NEW, "temperature": 1.5,
                "seed": seed, "logit_bias": bias}
        status, answer = call(url, "/v1/chat/completions", body, key=None)
        assert status == 200
        choice = answer["choices"][0]
        for made in choice["message"].get("tool_calls") or []:
            assert_valid_call(made["function"]["name"], made["function"]["arguments"])
        if choice["finish_reason"] != "length" and not choice["message"].get("tool_calls"):
            assert "<tool_call>" not in (choice["message"]["content"] or "")
    constraint = Grammar(HERMES.grammar(FUNCTIONS, True, HERMES.special(engine.tokenizer))).compile(
        engine.tokenizer, engine.runtime.vocab_size)
    matcher = constraint.matcher()
    for token in engine.tokenizer.encode("hello <tool_call>"):
        assert matcher.consume(token)
    refused = engine.tokenizer.encode('\n{"name": "rm", "arguments": {}}')
    assert not all(matcher.consume(token) for token in refused)


@pytest.mark.parametrize("mode", ["oracle", "adversarial", 2])
def test_scripted_drafts_under_the_tool_grammar_give_plain_decodings_tokens(mode):
    """Oracle, adversarial and planted-error drafts through the lazy tool grammar: token for token
    the plain constrained decoding (free text, trigger, call, end)."""
    engine = make_engine(False, TEMPLATE, "autoregressive")
    ids = ChatTemplate(engine.tokenizer, HERMES).encode(MESSAGES, TOOLS)
    spec = Grammar(HERMES.grammar(FUNCTIONS, True, frozenset()))
    rules = {"logit_bias": {int(k): float(v) for k, v in trigger_bias(engine.tokenizer).items()}}
    plain = engine.collect(torch.tensor([ids]), max_new_tokens=NEW, constraint=spec, **rules)
    assert "<tool_call>" in plain.text
    scripted = Engine(engine.model, engine.tokenizer, ScriptedDrafter(ids + plain.token_ids, 4, mode), "scripted",
                      draft_size="fixed")
    out = scripted.collect(torch.tensor([ids]), max_new_tokens=NEW, constraint=spec, **rules)
    assert out.token_ids == plain.token_ids
    assert out.stats.steps < plain.stats.steps or mode != "oracle"


def test_tools_reach_a_template_that_shows_them_and_the_system_turn_of_one_that_does_not():
    shown = tool_tokenizer(True, TOOLS_TEMPLATE)
    text = shown.decode(ChatTemplate(shown, HERMES).encode(MESSAGES, TOOLS))
    assert text.startswith("system: tools [") and '"get_weather"' in text
    bare = tool_tokenizer(False, TEMPLATE)
    text = bare.decode(ChatTemplate(bare, HERMES).encode(MESSAGES, TOOLS))
    assert text.startswith("system: " + HERMES.system_text(TOOLS)[:40]) and '"get_weather"' in text
    system_first = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    text = bare.decode(ChatTemplate(bare, HERMES).encode(system_first, TOOLS))
    assert text.startswith("system: Be brief.\n\n# Tools") and text.count("system:") == 1


ROUND_TRIP = [*MESSAGES,
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "paris", "days": 2}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


def test_tool_results_round_trip_through_the_template(served):
    engine, url = served
    template = ChatTemplate(engine.tokenizer, HERMES)
    text = engine.tokenizer.decode(template.encode(ROUND_TRIP, TOOLS))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", "days": 2}}\n</tool_call>' in text
    assert "tool: sunny, 21 C" in text
    answer = client_of(url).chat.completions.create(model=NAME, messages=ROUND_TRIP, tools=TOOLS, max_tokens=8,
                                                    temperature=0)
    assert answer.usage.prompt_tokens == len(template.encode(ROUND_TRIP, TOOLS))


def test_a_custom_role_is_rendered_and_a_template_that_refuses_it_names_it():
    engine = make_engine(False, TEMPLATE)
    strict = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    app = create_app(engine, lambda: Scheduler(engine.model, engine.drafter, max_batch=2, draft_size="fixed"),
                     ServeOptions(NAME))
    server, thread, url = start_server(app)
    try:
        messages = [{"role": "narrator", "content": "once upon a time"}, *MESSAGES]
        answer = client_of(url).chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0)
        rendered = ChatTemplate(engine.tokenizer, HERMES).encode(messages, None)
        assert engine.tokenizer.decode(rendered).startswith("narrator: once upon a time\n")
        assert answer.usage.prompt_tokens == len(rendered)
        engine.tokenizer.chat_template = strict
        app.state.service.translate.encode.template.tokenizer.chat_template = strict
        status, body = call(url, "/v1/chat/completions", {"model": NAME, "messages": [*MESSAGES, messages[0]],
                                                          "max_tokens": 4}, key=None)
        assert_error(status, body, 400, "messages[1].role")
        assert "unknown role narrator" in body["error"]["message"]
    finally:
        stop_server(server, thread)


@pytest.mark.parametrize("fmt, text, content, calls", [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x\\"}", "days": 3}}\n</tool_call>',
     "Let me look.\n", [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "x\\"}", "days": 3}')]),
    (HERMES, "no call at all <tool", "no call at all <tool", []),
    (FORMATS["llama3_json"], '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": '
                             '{"a": 3, "b": 4}}', "", [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')]),
    (FORMATS["llama3_json"], "The answer is 3.", "The answer is 3.", []),
], ids=["hermes", "hermes-text", "llama3", "llama3-text"])
def test_parsers_read_a_whole_answer_and_a_stream_alike(fmt, text, content, calls):
    parsed = fmt.parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls if c.complete] == calls
    stream, streamed_content, streamed = ToolStream(fmt), "", {}
    for i, char in enumerate(text):  # one character at a time: every split point
        for delta in stream.push(char, final=i == len(text) - 1):
            streamed_content += delta.get("content", "")
            for piece in delta.get("tool_calls", []):
                name, args = streamed.get(piece["index"], ("", ""))
                streamed[piece["index"]] = (name + piece["function"].get("name", ""),
                                            args + piece["function"]["arguments"])
    assert streamed_content == (content if not calls else content)
    assert list(streamed.values()) == calls


def test_llama3_json_grammar_makes_an_answer_that_opens_with_a_brace_a_call():
    engine = make_engine(False, TEMPLATE)
    fmt = FORMATS["llama3_json"]
    constraint = Grammar(fmt.grammar(FUNCTIONS, True, frozenset())).compile(engine.tokenizer, engine.runtime.vocab_size)
    free = constraint.matcher()
    assert all(free.consume(t) for t in engine.tokenizer.encode("The weather {is} fine"))
    opened = constraint.matcher()
    good = engine.tokenizer.encode('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert all(opened.consume(t) for t in good) and opened.accepting()
    wrong = constraint.matcher()
    assert not all(wrong.consume(t) for t in engine.tokenizer.encode('{"name": "sub"'))


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function"}]}]},
     "messages[0].tool_calls[0]"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "4", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    # from vLLM's tool_use/test_chat_completion_request_validations.py: a tool_choice needs tools, and
    # structured output beside a named call is refused (hasten refuses it beside auto too: one constraint)
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
      "structured_outputs": {"json": {"type": "object"}}}, "tools"),
    ({"tools": TOOLS, "structured_outputs": {"json": {"type": "object"}}}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(served, fields, param):
    engine, url = served
    body = {"model": NAME, "messages": MESSAGES, "max_tokens": 4, **fields}
    assert_error(*call(url, "/v1/chat/completions", body, key=None), 400, param)
