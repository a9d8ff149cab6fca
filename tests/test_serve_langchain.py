"""LangChain's tool-calling API against ``hasten serve`` (opt-in: ``pytest -m langchain``).

LangChain is not one of hasten's dependencies and is not in the lock: the client runs in an environment
of its own, named by ``HASTEN_LANGCHAIN_PYTHON`` (e.g. ``python -m venv /tmp/lc && /tmp/lc/bin/pip
install langchain-openai``, then ``HASTEN_LANGCHAIN_PYTHON=/tmp/lc/bin/python``), against a server this
test starts over the tiny model of tests/test_serve_tools.py. ``ChatOpenAI(...).bind_tools(tools)``
sends tools and no tool_choice (auto); its ``tool_calls``, streamed and not, and a ``ToolMessage``
round trip must work."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = pytest.mark.langchain
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from hasten.engine.batch import Scheduler  # noqa: E402
from hasten.serve.app import ServeOptions, create_app  # noqa: E402
from test_serve import TEMPLATE, start_server, stop_server  # noqa: E402
from test_serve_tools import NAME, TOOLS, assert_valid_call, make_engine, trigger_bias  # noqa: E402

CLIENT = r'''
import json, sys
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI

base, name, tools, bias = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
llm = ChatOpenAI(base_url=base, api_key="none", model=name, temperature=0, max_tokens=48,
                 logit_bias={int(k): v for k, v in bias.items()})
agent = llm.bind_tools(tools, parallel_tool_calls=False)  # no tool_choice: auto
question = [HumanMessage("what is the weather in paris?")]
answer = agent.invoke(question)
streamed = None
for chunk in agent.stream(question):
    streamed = chunk if streamed is None else streamed + chunk
follow = agent.invoke([*question, answer, ToolMessage("sunny, 21 C", tool_call_id=answer.tool_calls[0]["id"])])
print(json.dumps({"calls": answer.tool_calls, "finish": answer.response_metadata.get("finish_reason"),
                  "streamed": streamed.tool_calls, "follow_up": follow.response_metadata.get("finish_reason")}))
'''


@pytest.fixture(scope="module")
def langchain_python(request):
    if "langchain" not in (request.config.option.markexpr or ""):
        pytest.skip("opt-in: pytest -m langchain")
    python = os.environ.get("HASTEN_LANGCHAIN_PYTHON")
    if not python or not os.path.exists(python):
        pytest.skip("set HASTEN_LANGCHAIN_PYTHON to a Python with langchain-openai (see this file's docstring)")
    return python


def test_langchain_bind_tools_calls_a_tool_streamed_and_not(langchain_python):
    engine = make_engine(False, TEMPLATE)
    app = create_app(engine, lambda: Scheduler(engine.model, engine.drafter, max_batch=2, draft_size="fixed"),
                     ServeOptions(NAME))
    server, thread, url = start_server(app)
    try:
        done = subprocess.run([langchain_python, "-c", CLIENT, f"{url}/v1", NAME, json.dumps(TOOLS),
                               json.dumps(trigger_bias(engine.tokenizer))], capture_output=True, text=True,
                              timeout=300)
    finally:
        stop_server(server, thread)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    (made,) = result["calls"]
    assert result["finish"] == "tool_calls" and made["type"] == "tool_call"
    assert_valid_call(made["name"], json.dumps(made["args"]))
    assert [(c["name"], c["args"]) for c in result["streamed"]] == [(made["name"], made["args"])]
    assert result["follow_up"] in ("stop", "length", "tool_calls")
