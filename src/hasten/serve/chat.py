"""A chat's messages through the model's chat template, as vLLM renders them.

* **Roles**: any role is passed to the template; one it cannot render is a 400 naming
  ``messages[i].role`` with the template's own reason (the first message whose conversation the
  template refuses).
* **Tools**: given to the template (``tools=``) where it shows them; a template that shows no tools
  (SmolLM2's: rendering with and without them gives the same text) gets them written into its system
  turn, for ``tool_choice`` auto, by the tool-call format
  (:meth:`~.tool_parsers.ToolFormat.system_text`: Qwen2.5's words for Hermes), and an assistant
  turn's earlier ``tool_calls`` written into its content as that format writes a call.
* **Tool results**: an assistant message with ``tool_calls`` (their ``arguments``, JSON text in
  OpenAI's API, are given to the template as objects, as vLLM does) and ``role: "tool"`` messages with
  their ``tool_call_id`` go to the template as they are.
"""
from __future__ import annotations

import json

from .schema import APIError, invalid
from .tool_parsers import ToolFormat

STANDARD_ROLES = ("system", "developer", "user", "assistant", "tool")
_PROBE_TOOL = {"type": "function", "function": {"name": "hasten_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CHAT = [{"role": "user", "content": "hi"}]


class ChatTemplate:
    """One tokenizer's chat template and what it shows (checked once, by rendering probes)."""

    def __init__(self, tokenizer, fmt: ToolFormat):
        self.tokenizer, self.format = tokenizer, fmt
        self._shows_tools: bool | None = None

    @property
    def shows_tools(self) -> bool:
        """Whether the template writes the tools it is given (else hasten writes them, in the system turn)."""
        if self._shows_tools is None:
            try:
                self._shows_tools = self._text(_PROBE_CHAT, [_PROBE_TOOL]) != self._text(_PROBE_CHAT, None)
            except Exception:  # noqa: BLE001 - a template that fails on tools does not show them
                self._shows_tools = False
        return self._shows_tools

    def encode(self, messages: list[dict], tools: list[dict] | None, write_tools: bool = True) -> list[int]:
        """The chat's input ids with the assistant's turn opened; a 400 naming the message the
        template refuses. ``write_tools``: write the tools into the system turn where the template shows
        none (``tool_choice`` auto, where the model must know them to call one; a required or named call
        is the grammar's, and such a template gets them as before: not at all)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("messages", "this model's tokenizer has no chat template, so it cannot format chat "
                          "messages: send plain text to /v1/completions instead")
        messages = [_for_template(message) for message in messages]
        if not self.shows_tools:
            messages = [self._calls_as_content(message) for message in messages]
            if tools and write_tools:
                messages = self._tools_in_system_turn(messages, tools)
            tools = None
        try:
            return self._ids(messages, tools)
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError and what a template's own code raises
            raise self._refusal(messages, tools, err) from None

    def _tools_in_system_turn(self, messages: list[dict], tools: list[dict]) -> list[dict]:
        text, written = self.format.system_text(tools), messages
        if written and written[0]["role"] == "system":
            return [{**written[0], "content": f"{written[0]['content'] or ''}\n\n{text}".lstrip()}, *written[1:]]
        return [{"role": "system", "content": text}, *written]

    def _calls_as_content(self, message: dict) -> dict:
        if not message.get("tool_calls"):
            return message
        calls = "\n".join(self.format.call_text(call["function"]["name"], call["function"]["arguments"])
                          for call in message["tool_calls"])
        content = f"{message.get('content') or ''}\n{calls}".lstrip("\n")
        return {key: value for key, value in {**message, "content": content}.items() if key != "tool_calls"}

    def _ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, **({"tools": tools} if tools else {}))
        return list(encoded["input_ids"])

    def _text(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **({"tools": tools} if tools else {}))

    def _refusal(self, messages: list[dict], tools: list[dict] | None, err: Exception) -> APIError:
        """The template's refusal, naming the first message whose conversation so far it cannot render:
        its role where that role is not one of OpenAI's."""
        reason = str(err) or type(err).__name__
        for i in range(len(messages)):
            try:
                self._text(messages[: i + 1], tools)
            except Exception:  # noqa: BLE001
                role = messages[i]["role"]
                if role not in STANDARD_ROLES:
                    return invalid(f"messages[{i}].role", f"'messages[{i}].role' is {json.dumps(role)[:40]}, which "
                                   f"this model's chat template does not render: {reason}")
                break
        return invalid("messages", f"the chat template refused these messages: {reason}")


def _for_template(message: dict) -> dict:
    """A checked message as templates read it: tool calls' arguments as objects (vLLM's rule)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # not JSON: the template gets the text
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}
