"""One default dtype for every door (issue 58): ``hasten.load``, ``hasten generate`` and ``hasten
serve`` pick the same dtype for a model they load (bfloat16 on a CPU with native bfloat16
instructions, else float32: ``hasten.arguments.resolve_dtype``), so the same greedy request gives the
same text through the library and the command line; a model object passed in keeps its own dtype.

The suite runs as on a CPU without bfloat16 instructions (tests/conftest.py), so tests comparing
``hasten.load`` with Hugging Face float32 hold on any machine; here each machine is simulated."""
from __future__ import annotations

import json

import pytest
import torch

import hasten
from helpers import save_checkpoint, tiny_model, tiny_tokenizer

PROMPT = "def add(a, b):\n    return a + b\n\ndef add("


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt"))


def bfloat16_cpu(monkeypatch, native: str | None) -> None:
    monkeypatch.setattr("hasten.arguments.native_bfloat16", lambda: native)


@pytest.mark.parametrize("native, expected", [(None, torch.float32), ("AMX", torch.bfloat16)])
def test_the_library_loads_in_the_command_lines_default_dtype(checkpoint, monkeypatch, native, expected):
    bfloat16_cpu(monkeypatch, native)
    assert hasten.load(checkpoint, "autoregressive").model.dtype == expected
    assert hasten.load(checkpoint, "autoregressive", dtype="float32").model.dtype == torch.float32
    given = tiny_model("llama")  # an object keeps its own dtype
    assert hasten.load(given, "autoregressive", tokenizer=tiny_tokenizer()).model.dtype == torch.float32


def test_the_same_request_gives_the_same_text_through_the_library_and_the_command_line(checkpoint, cli,
                                                                                      monkeypatch):
    bfloat16_cpu(monkeypatch, "AVX512-BF16")
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "12", "--json",
                         "--method", "prompt_lookup")
    record = json.loads(out)
    assert code == 0 and record["dtype"] == "bfloat16"
    assert err.count("\n") == 1 and "hasten.load's default is the same" in err
    library = hasten.load(checkpoint, "prompt_lookup").generate(PROMPT, max_new_tokens=12)
    assert record["token_ids"] == library.token_ids
