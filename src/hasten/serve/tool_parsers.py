"""Tool calls a model writes on its own (``tool_choice: "auto"``): one :class:`ToolFormat` per way a
model family writes them, as vLLM's ``--tool-call-parser NAME`` chooses among its parsers.

A format does three things:

* its **grammar** (:meth:`ToolFormat.grammar`, a Lark grammar for llguidance): free text, unconstrained,
  until the format's trigger appears; from the trigger on, a call of one of the request's functions with
  arguments valid under that function's ``parameters`` (a lazy lexeme ends the free text at the trigger's
  first occurrence, so a trigger cannot be written without a well-formed call after it);
* its **parser** (:meth:`ToolFormat.parse`): the text's content (what precedes the first call) and its
  calls, complete or still being written, read the same way from a finished answer and from a stream's
  text so far (a stream sends what grew since the last read: :class:`ToolStream`);
* its **system turn** (:meth:`ToolFormat.system_text`): how the tools are written into the system turn for
  a chat template that shows no tools itself (SmolLM2's): the text Qwen2.5's template writes.

JSON inside a call is written as hasten writes all JSON (no free whitespace, ``", "`` and ``": "``), its
keys in the order ``name``, then the arguments.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

# the JSON inside a call, as every JSON hasten writes (structured.llguidance.JSON_OPTIONS)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_END = re.compile(r"\s*\}")  # the call object's own closing brace, after its arguments
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the arguments' JSON text so far (all of it once complete)
    complete: bool  # the call's text ended as its format ends a call


@dataclass
class Parsed:
    content: str  # the text before the first call (a stream's: less a tail that may still become a trigger)
    calls: list[ParsedCall] = field(default_factory=list)


class ToolFormat:
    """One way of writing tool calls. ``trigger``: the text that opens a call; ``close``: the text that
    ends one; ``arguments_key``: the key the arguments are written under."""

    name: str
    trigger: str
    close: str
    arguments_key: str

    def grammar(self, functions: dict[str, dict], parallel: bool, special: set[str]) -> str:
        """The Lark grammar of an answer that may call ``functions`` (name -> parameters schema), at most
        one call unless ``parallel``; ``special``: the tokenizer's special tokens among the format's markers
        (written as token references: a special token is never free text)."""
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def markers(self) -> tuple[str, ...]:
        """The texts that may be one token of a model's vocabulary."""
        return (self.trigger, self.close)

    def special(self, tokenizer) -> frozenset[str]:
        """The markers ``tokenizer`` holds as added tokens, which the grammar engine reads as special
        tokens (never free text): the grammar names them as tokens."""
        added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
        return frozenset(marker for marker in self.markers() if marker in added)

    def system_text(self, tools: list[dict]) -> str:
        raise NotImplementedError

    def call_text(self, name: str, arguments) -> str:
        """One call as this format writes it (an assistant turn's earlier call, for a template that
        shows no tool calls)."""
        raise NotImplementedError

    def body_schema(self, functions: dict[str, dict]) -> str:
        """The JSON schema of one call's object: ``{"name": N, <arguments_key>: <args valid for N>}``."""
        options = [{"type": "object", "properties": {"name": {"const": name}, self.arguments_key: parameters},
                    "required": ["name", self.arguments_key], "additionalProperties": False}
                   for name, parameters in functions.items()]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def _marker(text: str, special: set[str]) -> str:
    """A marker in Lark: a special token's reference, else its text."""
    return text if text in special else json.dumps(text)


class Hermes(ToolFormat):
    """Hermes and Qwen2.5's format (vLLM's ``hermes``): ``<tool_call>\\n{"name": ..., "arguments":
    {...}}\\n</tool_call>``, after any free text; several calls one after another."""

    name, trigger, close, arguments_key = "hermes", "<tool_call>", "</tool_call>", "arguments"

    def grammar(self, functions: dict[str, dict], parallel: bool, special: set[str]) -> str:
        body = f'"\\n"? %json {self.body_schema(functions)} "\\n"? {_marker(self.close, special)}'
        if self.trigger in special:  # a special token: free text cannot hold it, no lazy lexeme needed
            head = f"call: FREE {self.trigger} {body}\nFREE: /(.|\\n)*/\n"
            tail = "after: FREE"
        else:  # text: the free text ends at the trigger's first occurrence, and none may follow the calls
            head = f"call_head[lazy]: /(.|\\n)*/ {json.dumps(self.trigger)}\ncall: call_head {body}\n"
            tail = f"after: AFTER\nAFTER: /(?s:.*)/ & ~/(?s:.*){re.escape(self.trigger)}(?s:.*)/"
        return f"%llguidance {{}}\nstart: call{'*' if parallel else '?'} after\n{head}{tail}\n"

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.trigger)
        if start < 0:
            return Parsed(text if final else _hold_back(text, self.trigger))
        parsed, at = Parsed(text[:start]), start
        while at >= 0:
            call, end = _read_call(text, at + len(self.trigger))
            if call is None:
                break
            rest = text[end:].lstrip()
            call.complete = call.complete and rest.startswith(self.close)
            parsed.calls.append(call)
            if not call.complete:
                break
            at = text.find(self.trigger, end)
        return parsed

    def system_text(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def call_text(self, name: str, arguments) -> str:
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{self.trigger}\n{call}\n{self.close}"


class Llama3Json(ToolFormat):
    """Llama 3.1-3.3's JSON format (vLLM's ``llama3_json``): the whole answer is the calls,
    ``{"name": ..., "parameters": {...}}``, several joined by ``"; "``, optionally after the
    ``<|python_tag|>`` token; an answer that does not begin with ``{`` is free text."""

    name, trigger, close, arguments_key = "llama3_json", "{", "", "parameters"
    python_tag = "<|python_tag|>"

    def grammar(self, functions: dict[str, dict], parallel: bool, special: set[str]) -> str:
        tag = f"{self.python_tag}? " if self.python_tag in special else ""
        more = ' ("; " call)*' if parallel else ""
        return (f"%llguidance {{}}\nstart: FREE | {tag}call{more}\nFREE: /([^{{](.|\\n)*)?/\n"
                f"call: %json {self.body_schema(functions)}\n")

    def parse(self, text: str, final: bool) -> Parsed:
        if not text.startswith(self.trigger):
            return Parsed(text)
        parsed, at = Parsed(""), 0
        while True:
            call, end = _read_call(text, at + 1, opened=True)
            if call is None:
                break
            parsed.calls.append(call)
            if not call.complete or not text.startswith("; {", end):
                break
            at = end + 2
        return parsed

    def markers(self) -> tuple[str, ...]:
        return (self.python_tag,)

    def system_text(self, tools: list[dict]) -> str:
        listed = "\n\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format "
                '{"name": function name, "parameters": dictionary of argument name and its value}. '
                f"Do not use variables.\n\n{listed}")

    def call_text(self, name: str, arguments) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)


FORMATS: dict[str, ToolFormat] = {fmt.name: fmt for fmt in (Hermes(), Llama3Json())}
DEFAULT_FORMAT = "hermes"


def format_for_template(template: str | None) -> ToolFormat:
    """The format a chat template's own tools section asks for: Llama 3's where it writes its JSON
    instruction or ``<|python_tag|>``, else Hermes (Qwen2.5's, and what hasten writes into the system
    turn of a template that shows no tools)."""
    if template and "<tool_call>" not in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return FORMATS["llama3_json"]
    return FORMATS[DEFAULT_FORMAT]


def _hold_back(text: str, trigger: str) -> str:
    """``text`` less a tail that is the start of ``trigger`` (a stream cannot send it yet)."""
    for size in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-size:]):
            return text[:-size]
    return text


def _read_call(text: str, at: int, opened: bool = False) -> tuple[ParsedCall | None, int]:
    """The call whose JSON object starts at ``text[at:]`` (after its trigger; ``opened``: the object's
    ``{`` was the trigger) and where its object ends; (None, at) before its name is complete."""
    head = CALL_HEAD.match(("{" if opened else "") + text[at:])
    if head is None:
        return None, at
    try:
        name = json.loads(f'"{head[1]}"')
    except ValueError:  # not a JSON string: no call (a grammar-held call never gets here)
        return None, at
    start = at + head.end() - (1 if opened else 0)
    end = _value_end(text, start)
    if end is None:  # the arguments are still being written
        return ParsedCall(name, text[start:], False), len(text)
    close = CALL_END.match(text, end)
    complete = close is not None
    return ParsedCall(name, text[start:end], complete), close.end() if complete else len(text)


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at ``text[start]`` ends (None: not yet)."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        char = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        elif depth == 0 and char in ",}; \n":  # a number, true, false or null ends
            return i
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_calls(calls: list[ParsedCall]) -> list[dict]:
    """OpenAI's ``tool_calls`` of the complete calls."""
    return [{"id": call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in calls if call.complete]


class ToolStream:
    """A stream's tool calls as vLLM streams them: content deltas before the first call, then for each
    call a delta with its id, type and name, then deltas of its ``function.arguments``."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.text, self.sent_content, self.ids, self.sent_arguments = fmt, "", 0, [], []

    def push(self, piece: str, final: bool = False) -> list[dict]:
        """The deltas ``piece`` adds (each a chat delta: ``{"content": ...}`` or ``{"tool_calls": [...]}``)."""
        self.text += piece
        parsed = self.fmt.parse(self.text, final)
        deltas = []
        if len(parsed.content) > self.sent_content and not self.ids:
            deltas.append({"content": parsed.content[self.sent_content:]})
            self.sent_content = len(parsed.content)
        for index, call in enumerate(parsed.calls):
            if index == len(self.ids):
                self.ids.append(call_id())
                self.sent_arguments.append(0)
                deltas.append({"tool_calls": [{"index": index, "id": self.ids[index], "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            grown = call.arguments[self.sent_arguments[index]:]
            if grown:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": grown}}]})
                self.sent_arguments[index] = len(call.arguments)
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.ids)
