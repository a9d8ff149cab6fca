"""OpenAI request bodies -> checked parameters, and OpenAI-style errors.

Every refusal is an :class:`APIError` whose JSON is OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` with ``param`` naming the offending field, so a client library shows
the user which field to fix. Fields hasten does not know are ignored (clients send extras);
known fields of the wrong type or out of range are refused.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..engine.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4  # as OpenAI
MAX_SEED = 2**63 - 1
MAX_CHOICES = 16  # n: choices per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request
TEMPERATURE_RANGE = (0.0, 2.0)  # as OpenAI; hasten itself would take any temperature >= 0
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # a bias outside it is clamped to it, as OpenAI and vLLM
MAX_TOKEN_ID_LIST = 1 << 16  # the most ids stop_token_ids, allowed_token_ids or logit_bias may hold
# The operator's cap on a request that sets no max_tokens (--default-max-tokens). OpenAI's chat
# default, the room left in the context, is sized for OpenAI's hardware: on a 2-core CPU a chat
# without max_tokens sampled 5,400 tokens and held the server 16.5 minutes (issue 44). 512 tokens
# is longer than most answers and about a minute and a half at the 5.5 tokens/s of that run.
DEFAULT_MAX_TOKENS = 512


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param, code)


@dataclass(frozen=True)
class Params:
    """What both endpoints share, checked."""

    model: str
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float | None
    top_k: int | None
    stop: tuple[str, ...]
    seed: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: with include_usage, usage in every event
    n: int = 1  # choices per prompt; choice j of a seeded request samples with seed + j
    logprobs: int | None = None  # each generated token's log-probability, with this many alternatives (None: off)
    prompt_logprobs: int | None = None  # each prompt token's, with this many alternatives (vLLM's field; None: off)
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its tokens' log-probabilities) first
    rules: dict = field(default_factory=dict)  # the Sampling fields that transform the target's logits, when set
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: end a choice after any of these, as after EOS
    ignore_eos: bool = False  # vLLM's: EOS does not end a choice
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string or stop token stays in the text
    best_of: int = 1  # samples per prompt, of which the n with the highest mean log-probability per token return
    speculate: bool = True  # hasten's: false decodes this request plainly (the same text, no drafting)
    structured: object = None  # serve.structured.Structured: the structured output asked for (None: free text)
    pool: bool = True  # hasten's: false, the request neither drafts from the server's shared pool nor adds to it


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body (400 for anything else, NaN and Infinity included)."""
    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}", None, "invalid_json") from None
    except RecursionError:  # a small body can nest past the parser's depth
        raise APIError(400, "the request body nests too deeply to be a request", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    return body


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def optional(body: dict, name: str, check, expected: str, default=None):
    """``body[name]`` if present and not null, checked by ``check``; else ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise invalid(name, f"'{name}' must be {expected}, got {json.dumps(value)[:80]}", "invalid_type")
    return value


def parse_params(body: dict, max_tokens_names: tuple[str, ...] = ("max_tokens",), chat: bool = False) -> Params:
    model = body.get("model")
    if model is None or model == "":
        raise invalid("model", "'model' is required: the name GET /v1/models lists", "missing_required_parameter")
    if not isinstance(model, str):
        raise invalid("model", f"'model' must be a string (the name GET /v1/models lists), got {json.dumps(model)[:40]}",
                      "invalid_type")
    max_tokens = None
    for name in max_tokens_names:  # chat also takes OpenAI's newer name, max_completion_tokens
        value = optional(body, name, is_int, "an integer")  # its range: checked once, at admission
        if value is not None:
            max_tokens = value
    temperature = optional(body, "temperature", is_number, "a number", 1.0)
    low, high = TEMPERATURE_RANGE
    if not low <= temperature <= high:
        raise invalid("temperature", f"'temperature' must be in [{low:g}, {high:g}] (0 is greedy), got {temperature}")
    top_p = optional(body, "top_p", is_number, "a number")
    if top_p is not None and not 0 < top_p <= 1:
        raise invalid("top_p", f"'top_p' must be in (0, 1], got {top_p}")
    top_k = optional(body, "top_k", is_int, "an integer")  # an extension, as in vLLM
    if top_k is not None and top_k < 1:
        raise invalid("top_k", f"'top_k' must be at least 1, got {top_k}")
    seed = optional(body, "seed", is_int, "an integer")
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise invalid("seed", f"'seed' must be in [0, 2^63 - 1], got {seed}")
    stream = optional(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    include_usage, continuous_usage = parse_stream_options(body, stream)
    n, best_of = parse_choices(body, stream)
    logprobs, prompt_logprobs, echo = parse_logprobs(body, chat, stream)
    if max_tokens == 0 and not echo:
        name = next(name for name in max_tokens_names if body.get(name) == 0)
        raise invalid(name, f"'{name}' must be at least 1; 0 only asks a completion to score its prompt, with "
                      "'echo': true")
    check_unsupported(body)
    rules = parse_rules(body)
    stop_token_ids = _token_ids(body, "stop_token_ids", allow_empty=True) or ()
    ignore_eos = optional(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false", False)
    include_stop = optional(body, "include_stop_str_in_output", lambda v: isinstance(v, bool), "true or false", False)
    speculate = optional(body, "speculate", lambda v: isinstance(v, bool), "true or false", True)
    pool = optional(body, "pool", lambda v: isinstance(v, bool), "true or false", True)
    return Params(model, max_tokens, float(temperature), None if top_p is None else float(top_p), top_k,
                  parse_stop(body), seed, stream, include_usage, continuous_usage, n, logprobs, prompt_logprobs, echo,
                  rules, tuple(stop_token_ids), ignore_eos, include_stop, best_of, speculate, pool=pool)


def _token_ids(body: dict, name: str, allow_empty: bool) -> list[int] | None:
    """A list of token ids (their range against the vocabulary is the scheduler's check)."""
    ids = optional(body, name, lambda v: isinstance(v, list) and all(is_int(t) for t in v), "a list of token ids")
    if ids is not None and (len(ids) > MAX_TOKEN_ID_LIST or not (ids or allow_empty)):
        raise invalid(name, f"'{name}' must hold 1 to {MAX_TOKEN_ID_LIST} token ids, got {len(ids)}")
    return ids


def parse_rules(body: dict) -> dict:
    """The fields that transform the target distribution (hasten.core.sampling.Sampling's
    names), only those present and not neutral: a request without them does no extra work."""
    rules = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = optional(body, name, is_number, "a number", 0)
        low, high = PENALTY_RANGE
        if not low <= value <= high:
            raise invalid(name, f"'{name}' must be in [{low:g}, {high:g}], got {value}")
        if value:
            rules[name] = float(value)
    repetition = optional(body, "repetition_penalty", is_number, "a number", 1)
    if repetition <= 0:
        raise invalid("repetition_penalty", f"'repetition_penalty' must be > 0 (1 is none), got {repetition}")
    if repetition != 1:
        rules["repetition_penalty"] = float(repetition)
    min_p = optional(body, "min_p", is_number, "a number", 0)
    if not 0 <= min_p <= 1:
        raise invalid("min_p", f"'min_p' must be in [0, 1], got {min_p}")
    if min_p:
        rules["min_p"] = float(min_p)
    min_tokens = optional(body, "min_tokens", is_int, "an integer", 0)
    if min_tokens < 0:  # more than max_tokens: the request refuses it at admission
        raise invalid("min_tokens", f"'min_tokens' must be in [0, max_tokens], got {min_tokens}")
    if min_tokens:
        rules["min_tokens"] = min_tokens
    bias = optional(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token id: bias")
    if bias:
        if len(bias) > MAX_TOKEN_ID_LIST:
            raise invalid("logit_bias", f"'logit_bias' holds {len(bias)} tokens; at most {MAX_TOKEN_ID_LIST}")
        pairs = {}
        for key, value in bias.items():
            token = key if is_int(key) else int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() \
                else None
            if token is None or not is_number(value):
                raise invalid("logit_bias", f"'logit_bias' maps token ids to numbers, got {json.dumps(key)}: "
                              f"{json.dumps(value)[:40]}", "invalid_type")
            low, high = LOGIT_BIAS_RANGE
            pairs[token] = min(max(float(value), low), high)
        rules["logit_bias"] = tuple(sorted(pairs.items()))
    allowed = _token_ids(body, "allowed_token_ids", allow_empty=False)
    if allowed is not None:
        rules["allowed_token_ids"] = tuple(sorted(set(allowed)))
    return rules


def _count(body: dict, name: str) -> int | None:
    """A number of log-probability alternatives, 0 to MAX_TOP_LOGPROBS (None when absent)."""
    count = optional(body, name, is_int, "an integer")
    if count is not None and not 0 <= count <= MAX_TOP_LOGPROBS:
        raise invalid(name, f"'{name}' must be in [0, {MAX_TOP_LOGPROBS}], got {count}")
    return count


def parse_logprobs(body: dict, chat: bool, stream: bool) -> tuple[int | None, int | None, bool]:
    """(alternatives per generated token or None, per prompt token or None, echo).

    Completions: ``logprobs`` is the count (OpenAI's legacy field; false or null: off) and
    ``echo`` prepends the prompt. Chat: ``logprobs`` is true or false and ``top_logprobs`` the
    count, which needs ``logprobs: true`` (as OpenAI). ``prompt_logprobs`` (vLLM's) either way,
    not streamed (as vLLM)."""
    if chat:
        on = optional(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
        top = _count(body, "top_logprobs")
        if top is not None and not on:
            raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
        logprobs = (top or 0) if on else None
        if optional(body, "echo", lambda v: isinstance(v, bool), "true or false", False):
            raise invalid("echo", "'echo' is a completions field; hasten serve's chat route does not echo",
                          "unsupported_parameter")
        echo = False
    else:
        logprobs = None if body.get("logprobs") is False else _count(body, "logprobs")
        echo = optional(body, "echo", lambda v: isinstance(v, bool), "true or false", False)
    prompt_logprobs = _count(body, "prompt_logprobs")
    if prompt_logprobs is not None and stream:
        raise invalid("prompt_logprobs", "'prompt_logprobs' is not available with 'stream': true (as in vLLM); "
                      "a streamed completion with 'echo' and 'logprobs' scores its prompt")
    return logprobs, prompt_logprobs, echo


def parse_choices(body: dict, stream: bool) -> tuple[int, int]:
    """``n`` (choices per prompt, 1 to MAX_CHOICES) and ``best_of`` (samples per prompt, n to
    MAX_CHOICES, default n): the n of them with the highest mean log-probability per token are
    returned, which is known only once all have ended, so best_of > n cannot be streamed (as OpenAI)."""
    n = optional(body, "n", is_int, "an integer", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"'n' must be in [1, {MAX_CHOICES}], got {n}")
    best_of = optional(body, "best_of", is_int, "an integer", n)
    if not n <= best_of <= MAX_CHOICES:
        raise invalid("best_of", f"'best_of' must be in ['n', {MAX_CHOICES}] = [{n}, {MAX_CHOICES}], got {best_of}")
    if best_of > n and stream:
        raise invalid("best_of", "'best_of' > 'n' picks the best samples once all have ended, so it cannot be "
                      "streamed; leave out 'stream' or set 'best_of' to 'n'")
    return n, best_of


def parse_stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(not s for s in stops):
        raise invalid("stop", "'stop' strings must not be empty")
    return tuple(stops)


def parse_stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(``include_usage``: a last event with the usage; usage in every event as well, vLLM's
    ``continuous_usage_stats``, which as in vLLM counts only with ``include_usage``)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise invalid("stream_options", "'stream_options' must be an object", "invalid_type")
    if not stream:
        raise invalid("stream_options", "'stream_options' is only allowed with 'stream': true")
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        flag = options.get(name)
        if flag is not None and not isinstance(flag, bool):
            raise invalid(f"stream_options.{name}", f"'stream_options.{name}' must be true or false", "invalid_type")
        flags.append(bool(flag))
    include, continuous = flags
    return include, include and continuous


# Fields hasten knows and cannot honour: refused rather than silently ignored, since the
# client would otherwise get an answer to a question it did not ask. Each maps to a test
# of the values that are the same as leaving it out.
def _empty(v) -> bool:
    return v is None or v in ([], {}, "")


UNSUPPORTED = {
    # OpenAI's (structured output and tools: serve.structured)
    "suffix": _empty,
    "functions": _empty, "function_call": lambda v: v in (None, "none", "auto"),
    # vLLM's extras, which clients written for vLLM send
    "bad_words": _empty,
}


def check_unsupported(body: dict) -> None:
    for name, harmless in UNSUPPORTED.items():
        if name in body and not harmless(body[name]):
            raise invalid(name, f"'{name}' is not supported by hasten serve", "unsupported_parameter")


def parse_prompts(body: dict) -> list[str | list[int]]:
    """A completion's prompts, in order: a string, a list of token ids, or a list of several of
    either (each one prompt, answered by its own choices)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "'prompt' is required", "missing_required_parameter")
    several = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if several else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise invalid("prompt", f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    return [_one_prompt(p, f"prompt[{i}]" if several else "prompt") for i, p in enumerate(prompts)]


def _one_prompt(prompt, name: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", f"'{name}' is empty")
        return unicode_text(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt
    raise invalid("prompt", f"'{name}' must be a non-empty string or a list of token ids", "invalid_type")


def parse_messages(body: dict) -> list[dict]:
    """Chat messages with their content as plain text (OpenAI's text parts are joined), for the chat
    template (:mod:`.chat`). A role is any non-empty string: the template decides what it renders, as in
    vLLM. An assistant message may carry ``tool_calls`` (then its content may be null), a ``tool``
    message its ``tool_call_id``; a message's ``name`` is kept."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list of {role, content} objects",
                      "missing_required_parameter" if messages is None else "invalid_type")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message, where: str) -> dict:
    if not isinstance(message, dict):
        raise invalid(where, f"'{where}' must be an object with a 'role' and a 'content'", "invalid_type")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise invalid(f"{where}.role", f"'{where}.role' must be a non-empty string, got {json.dumps(role)[:40]}",
                      "missing_required_parameter" if role is None else "invalid_value")
    if not _empty(message.get("function_call")):
        raise invalid(f"{where}.function_call", f"'{where}.function_call' (OpenAI's deprecated form) is not "
                      "supported by hasten serve: send 'tool_calls'", "unsupported_parameter")
    plain = {"role": role}
    calls = message.get("tool_calls")
    if not _empty(calls):
        plain["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if message.get("content") is None:
        if "tool_calls" not in plain:
            raise invalid(f"{where}.content", f"'{where}.content' is required: a string or a list of text parts",
                          "missing_required_parameter")
        plain["content"] = None
    else:
        plain["content"] = content_text(message["content"], where)
    for name in ("tool_call_id", "name"):
        if message.get(name) is not None:
            if not isinstance(message[name], str):
                raise invalid(f"{where}.{name}", f"'{where}.{name}' must be a string", "invalid_type")
            plain[name] = unicode_text(message[name], f"{where}.{name}")
    return plain


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier calls: ``[{id, type: function, function: {name, arguments}}]``."""
    if not isinstance(calls, list):
        raise invalid(where, f"'{where}' must be a list of tool calls", "invalid_type")
    checked = []
    for j, call in enumerate(calls):
        here = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", ""), (str, dict)):
            raise invalid(here, f"'{here}' must be {{id, type: function, function: {{name, arguments}}}}",
                          "invalid_type")
        checked.append({"id": str(call.get("id", "")), "type": "function",
                        "function": {"name": function["name"], "arguments": function.get("arguments", "{}")}})
    return checked


def unicode_text(text: str, field: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON's ``"\\ud800"``) has no UTF-8 form,
    so no tokenizer can read it: 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise invalid(field, f"'{field}' is not valid Unicode text: a lone surrogate at character {err.start}",
                      "invalid_value") from None
    return text


def content_text(content, where: str) -> str:
    if isinstance(content, str):
        return unicode_text(content, f"{where}.content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise invalid(f"{where}.content[{j}]", "only text content parts ({type: text, text}) are supported",
                              "invalid_type")
            parts.append(unicode_text(part["text"], f"{where}.content[{j}]"))
        return "".join(parts)
    raise invalid(f"{where}.content", f"'{where}.content' must be a string or a list of text parts", "invalid_type")
