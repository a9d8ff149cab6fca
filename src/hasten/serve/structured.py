"""Structured output in the server's words: the request fields that ask for it, read into one
:class:`Structured` (a :mod:`hasten.structured` spec and the field that asked), and tool calls.

Fields: OpenAI's ``response_format`` (``json_object``; ``json_schema`` with ``strict``: every schema
is followed strictly), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``) and its older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``, and chat's ``tools`` with ``tool_choice`` ``"required"`` (a JSON array of
``{"name", "parameters"}`` calls, as vLLM constrains it), a named function (its arguments), or
``"auto"`` (the default with tools: the model's free text, in which the server's tool-call format's
trigger opens a call constrained to one of the tools, :mod:`.tool_parsers`), answered as OpenAI
``tool_calls``. At most one of them per request; every refusal names its field.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ..core.constraint import ConstraintError
from .schema import invalid
from .tool_parsers import openai_calls

VLLM_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's structured_outputs options that change nothing here: hasten writes JSON without free
# whitespace and follows additionalProperties as the schema says
IGNORED_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties", "backend")


@dataclass(frozen=True)
class Structured:
    spec: object  # a hasten.structured spec
    field: str  # the request field that asked for it, as the client wrote it
    tool: str | None = None  # None: text; "required": an array of calls; "auto": the format's calls in free
    # text; else the named function's name
    format: object = None  # with "auto": the serve.tool_parsers.ToolFormat that reads the calls


def parse_structured(body: dict, chat: bool, tool_format=None, special: frozenset = frozenset()) -> Structured | None:
    """The structured output a request asks for, checked (None: free text). ``tool_format``: how the
    model writes tool calls (``tool_choice: "auto"``), ``special``: its markers that are special tokens."""
    asked = []
    if body.get("response_format") is not None:
        asked.append(_response_format(body["response_format"]))
    if body.get("structured_outputs") is not None:
        asked.append(_structured_outputs(body["structured_outputs"]))
    for name, kind in VLLM_GUIDED.items():
        if body.get(name) is not None:
            asked.append(_spec(kind, body[name], name))
    if chat:
        tools = _tools(body, tool_format, special)
        if tools is not None:
            asked.append(tools)
    elif not _absent_or_empty(body.get("tools")):
        raise invalid("tools", "'tools' belongs to chat completions (/v1/chat/completions)", "unsupported_parameter")
    asked = [item for item in asked if item is not None]
    if len(asked) > 1:
        raise invalid(asked[1].field, f"'{asked[1].field}' and '{asked[0].field}' both ask for structured output; "
                      "give one", "conflicting_parameters")
    return asked[0] if asked else None


def _absent_or_empty(value) -> bool:
    return value is None or value in ([], {})


def _spec(kind: str, value, field: str) -> Structured:
    """A spec of ``kind`` from a field's value; a bad one is a 400 naming the field."""
    from ..structured import Choice, Grammar, JsonSchema, Regex

    try:
        if kind == "json":
            if not isinstance(value, (dict, str)):
                raise invalid(field, f"'{field}' must be a JSON schema (an object or its JSON text)", "invalid_type")
            return Structured(JsonSchema(value), field)
        if kind == "json_object":
            return Structured(JsonSchema(), field)
        if kind == "choice":
            if not isinstance(value, list):
                raise invalid(field, f"'{field}' must be a list of strings", "invalid_type")
            return Structured(Choice(value), field)
        if not isinstance(value, str):
            raise invalid(field, f"'{field}' must be a string", "invalid_type")
        return Structured(Regex(value) if kind == "regex" else Grammar(value), field)
    except ConstraintError as err:
        raise invalid(field, f"'{field}': {err}", err.code) from None


def _response_format(value) -> Structured | None:
    if not isinstance(value, dict):
        raise invalid("response_format", "'response_format' must be an object with a 'type'", "invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_object", None, "response_format")
    if kind == "json_schema":
        schema = value.get("json_schema")
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema", "'response_format.json_schema' must be an object with a "
                          "'name' and a 'schema'", "invalid_type")
        strict = schema.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid("response_format.json_schema.strict", "'strict' must be true or false", "invalid_type")
        body = schema.get("schema", {})  # OpenAI's schema is optional: any JSON value then
        return _spec("json", body, "response_format.json_schema.schema")
    raise invalid("response_format.type", f"'response_format.type' must be text, json_object or json_schema, got "
                  f"{json.dumps(kind)[:40]}", "invalid_value")


def _structured_outputs(value) -> Structured:
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid(field, f"'{field}' must be an object", "invalid_type")
    kinds = [kind for kind in STRUCTURED_OUTPUT_KINDS if value.get(kind) not in (None, False)]
    unknown = sorted(set(value) - set(STRUCTURED_OUTPUT_KINDS) - set(IGNORED_OPTIONS))
    if unknown:
        raise invalid(f"{field}.{unknown[0]}", f"'{field}.{unknown[0]}' is not supported by hasten serve",
                      "unsupported_parameter")
    if len(kinds) != 1:
        raise invalid(field, f"'{field}' must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got "
                      f"{len(kinds)}", "invalid_value")
    return _spec(kinds[0], value[kinds[0]], f"{field}.{kinds[0]}")


def _tools(body: dict, tool_format, special: frozenset) -> Structured | None:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if _absent_or_empty(tools):
        if choice not in (None, "none"):
            raise invalid("tool_choice", "'tool_choice' needs 'tools'", "invalid_value")
        return None
    if not isinstance(tools, list) or not all(_function_of(tool) for tool in tools):
        raise invalid("tools", "'tools' must be a list of {type: function, function: {name, parameters}}",
                      "invalid_type")
    functions = {_function_of(tool)["name"]: _function_of(tool).get("parameters") or {"type": "object"}
                 for tool in tools}
    if choice == "none":
        return None
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "'parallel_tool_calls' must be true or false", "invalid_type")
    if choice in (None, "auto"):
        if tool_format is None:
            raise invalid("tool_choice", "'tool_choice' is 'auto' (the default with tools), which needs the "
                          "server's tool-call format (hasten serve --tool-call-parser NAME)", "unsupported_parameter")
        grammar = tool_format.grammar(functions, parallel, special)
        return Structured(_spec("grammar", grammar, "tools").spec, "tools", "auto", tool_format)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return Structured(_spec("json", schema, "tools").spec, "tools", "required")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise invalid("tool_choice", "'tool_choice' must be none, required, auto or {type: function, function: "
                      "{name}}", "invalid_value")
    if name not in functions:
        raise invalid("tool_choice", f"'tool_choice' names {name!r}, which is not among 'tools'", "invalid_value")
    return Structured(_spec("json", functions[name], "tools").spec, "tools", name)


def _function_of(tool) -> dict | None:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return None
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return None
    return function


def tool_calls(structured: Structured, text: str) -> list[dict] | None:
    """OpenAI's ``tool_calls`` for a tool request's text (None when the text is not a complete call:
    cut by max_tokens or a stop string)."""
    if structured.tool == "auto":
        return openai_calls(structured.format.parse(text, final=True).calls) or None
    if structured.tool == "required":
        try:
            calls = [(call["name"], json.dumps(call["parameters"], ensure_ascii=False)) for call in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return None
    else:
        try:
            json.loads(text)
        except ValueError:
            return None
        calls = [(structured.tool, text)]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}
            for name, args in calls]
