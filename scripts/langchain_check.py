#!/usr/bin/env python3
"""Check a running `hasten serve` with LangChain's OpenAI clients (docs/serve.md, "LangChain").

LangChain is not one of hasten's dependencies: run this from an environment that has
`langchain-openai` (e.g. `python -m venv /tmp/lc && /tmp/lc/bin/pip install langchain-openai`),
against a server started with `hasten serve --model ... --port 8123`:

    /tmp/lc/bin/python scripts/langchain_check.py http://127.0.0.1:8123/v1

`OpenAI.batch` sends the prompts as one completions request with a list of prompts; every answer
must equal the answer to that prompt alone (greedy). `ChatOpenAI.batch` likewise for chats.
Exit status 0 when all hold."""
import json
import sys
import urllib.request

from langchain_openai import ChatOpenAI, OpenAI

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHATS = ["Say hi.", "Name a colour."]


def main(base: str) -> int:
    model = json.load(urllib.request.urlopen(base + "/models"))["data"][0]["id"]
    llm = OpenAI(base_url=base, api_key="none", model=model, temperature=0, max_tokens=16)
    batch, single = llm.batch(PROMPTS), [llm.invoke(p) for p in PROMPTS]
    usage = llm.generate(PROMPTS).llm_output.get("token_usage")
    chat = ChatOpenAI(base_url=base, api_key="none", model=model, temperature=0, max_tokens=16)
    chat_batch = [m.content for m in chat.batch(CHATS)]
    chat_single = [chat.invoke(q).content for q in CHATS]
    print(f"OpenAI.batch of {len(PROMPTS)} == single requests: {batch == single}; usage {usage}")
    print(f"ChatOpenAI.batch of {len(CHATS)} == single requests: {chat_batch == chat_single}")
    return 0 if batch == single and chat_batch == chat_single and all(batch) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8123/v1"))
