#!/usr/bin/env python3
"""Check structured output of a running `hasten serve` with the official clients (docs/structured.md).

Run it from an environment that has `openai` and `pydantic` (hasten's own .venv does) and, for the
LangChain part, `langchain-openai` (not a dependency of hasten: e.g.
`python -m venv /tmp/lc && /tmp/lc/bin/pip install langchain-openai`), against a server started with
`hasten serve --model zoo:smollm2-135m --port 8123`:

    /tmp/lc/bin/python scripts/structured_check.py http://127.0.0.1:8123/v1

Checks: openai's `chat.completions.parse(response_format=PydanticModel)` returns a parsed object;
`tools` with a named `tool_choice` returns a tool call whose arguments parse into the function's
model; LangChain's `ChatOpenAI.with_structured_output(Model, method="json_schema")` returns an
instance (skipped, and said so, where LangChain is not installed). Exit status 0 when all hold.
"""
import json
import sys
import urllib.request

from openai import OpenAI
from pydantic import BaseModel, Field


class City(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


class Weather(BaseModel):
    location: str = Field(max_length=40)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


QUESTION = [{"role": "user", "content": "Where is the Eiffel Tower? Answer with the city and the country."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


def main(base: str) -> int:
    model = json.load(urllib.request.urlopen(base + "/models"))["data"][0]["id"]
    client = OpenAI(base_url=base, api_key="none")
    ok = True

    parsed = client.chat.completions.parse(model=model, messages=QUESTION, response_format=City, temperature=0,
                                           max_tokens=64).choices[0].message.parsed
    print(f"openai parse(response_format=City): {parsed!r}")
    ok &= isinstance(parsed, City)

    tool = {"type": "function", "function": {"name": "get_weather", "description": "the weather at a place",
                                             "parameters": Weather.model_json_schema()}}
    answer = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=[tool], temperature=0,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            max_tokens=64).choices[0]
    call = answer.message.tool_calls[0]
    arguments = Weather.model_validate_json(call.function.arguments)
    print(f"openai tools + named tool_choice: finish_reason={answer.finish_reason} {call.function.name}({arguments!r})")
    ok &= call.function.name == "get_weather"

    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        print("LangChain: not installed here (pip install langchain-openai); skipped")
    else:
        chat = ChatOpenAI(base_url=base, api_key="none", model=model, temperature=0, max_tokens=64)
        structured = chat.with_structured_output(City, method="json_schema").invoke(QUESTION[0]["content"])
        print(f"LangChain with_structured_output(City, method='json_schema'): {structured!r}")
        ok &= isinstance(structured, City)
    print("all parsed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8123/v1"))
