"""The real pretrained models (opt-in: `make test-real`, after `make real` installs them).

SmolLM2-135M-Instruct through hasten with prompt lookup must give, token for token, what
Hugging Face ``generate`` gives with the chat template applied; Gemma 3 270M must load and run.
"""
from __future__ import annotations

import time

import pytest
import torch

import hasten
from hasten import loading

pytestmark = pytest.mark.real

PASSAGE = (
    "The lighthouse on Kerrow Point was built in 1868 from granite quarried on the island. Its lamp was "
    "first lit with paraffin, switched to electricity in 1931, and automated in 1987, when the last keeper left."
)
QUESTION = "When was the lamp switched to electricity, and when did the last keeper leave? Quote the passage."


def available(name: str):
    """The model's local directory, or skip with the reason (say what to install)."""
    try:
        return loading.resolve_path(name)
    except ValueError as err:
        pytest.skip(f"{name} is not available ({err}); run `make real` first")


def chat_prompt(tokenizer, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_smollm2_chat_through_prompt_lookup_equals_hf_generate():
    available("zoo:smollm2-135m")
    engine = hasten.load("zoo:smollm2-135m", "prompt_lookup")
    assert type(engine.model).__name__ == "LlamaForCausalLM"
    assert 130e6 < sum(p.numel() for p in engine.model.parameters()) < 140e6
    tokenizer = engine.tokenizer
    prompt = chat_prompt(tokenizer, f"{PASSAGE}\n\n{QUESTION}")
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt_len]
    start = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=64)
    hasten_s = time.perf_counter() - start
    start = time.perf_counter()
    expected = engine.model.generate(ids, max_new_tokens=64, do_sample=False)  # [1, prompt_len + new]
    hf_s = time.perf_counter() - start
    assert out.token_ids == expected[0, ids.shape[1]:].tolist()
    assert "1931" in out.text  # a real answer, copied from the passage
    print(f"\nsmollm2-135m: tau {out.stats.mean_accepted:.2f}, {out.stats.new_tokens} tokens, hasten prompt_lookup "
          f"{hasten_s:.1f} s, HF generate {hf_s:.1f} s ({torch.get_num_threads()} thread(s))")


def test_gemma3_loads_and_runs_greedy_like_hf():
    available("zoo:gemma3-270m")
    engine = hasten.load("zoo:gemma3-270m", "prompt_lookup")
    assert type(engine.model).__name__ == "Gemma3ForCausalLM"
    assert 250e6 < sum(p.numel() for p in engine.model.parameters()) < 290e6
    prompt = f"{PASSAGE}\nQ: When was the lamp switched to electricity?\nA:"
    start = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=24)
    seconds = time.perf_counter() - start
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt_len]
    expected = engine.model.generate(ids, max_new_tokens=24, do_sample=False)  # [1, prompt_len + new]
    assert out.token_ids == expected[0, ids.shape[1]:].tolist()
    assert out.text.strip()
    print(f"\ngemma3-270m: tau {out.stats.mean_accepted:.2f}, {out.stats.new_tokens} tokens in {seconds:.1f} s: "
          f"{out.text.strip()[:80]!r}")


def test_smollm2_lean_forward_equals_its_own_forward_bit_for_bit(monkeypatch):
    """models/lean.py on the real model, packed weights on: a prefill, a one-token step and a
    7-token block give the logits of the model's own forward, bit for bit."""
    from hasten.models import cache as kv
    from hasten.models.adapter import ModelAdapter
    from hasten.models.hf import HuggingFaceRuntime

    available("zoo:smollm2-135m")
    model = loading.load_model("zoo:smollm2-135m", dtype=torch.float32).eval()
    HuggingFaceRuntime(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, 120), generator=torch.Generator().manual_seed(0))
    results = {}
    for use_lean in ("1", "0"):
        monkeypatch.setenv("HASTEN_LEAN_FORWARD", use_lean)
        adapter = ModelAdapter(model)
        assert (adapter._lean_modules is not None) == (use_lean == "1")
        adapter.start(prompt, logits=True)
        rows = [adapter.prompt_logits]
        for block in ([7], [7, 8, 9, 10, 11, 12, 13]):
            rows.append(adapter.forward(block, tree=None).logits)
            kv.crop(adapter.cache, prompt.shape[1] - 1)
        results[use_lean] = rows
    for lean_rows, own_rows in zip(results["1"], results["0"]):
        assert torch.equal(lean_rows, own_rows)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_smollm2_half_precision_blocks_equal_one_token_steps(dtype):
    """bfloat16 and float16 (models/invariant.py): every position of chains of 1 to 64 tokens and
    of a tree gets the logits of one-token steps, bit for bit, after caches of several lengths;
    and the default method's chat answer is plain decoding's, token for token."""
    from hasten.core.tree import TokenTree
    from hasten.models import cache as kv
    from hasten.models.adapter import ModelAdapter

    available("zoo:smollm2-135m")
    engine = hasten.load("zoo:smollm2-135m", dtype=dtype)
    model = engine.model
    generator = torch.Generator().manual_seed(0)
    tree = TokenTree((-1, 0, 0, 1, 2, -1))
    for cached in (5, 300):
        prompt = torch.randint(100, 40000, (cached + 1,), generator=generator).tolist()
        tokens = torch.randint(100, 40000, (64,), generator=generator).tolist()
        block = [prompt[-1], *tokens]
        stepper = ModelAdapter(model)
        stepper.start(torch.tensor([prompt]))
        steps = torch.stack([stepper.forward([token], None).logits[0] for token in block])  # [65, vocab]
        adapter = ModelAdapter(model)
        adapter.start(torch.tensor([prompt]))
        for size in (2, 8, 65):
            assert torch.equal(adapter.forward(block[:size], None).logits, steps[:size]), (cached, size)
            kv.crop(adapter.cache, cached)
        # nodes 0, 1 and 3 hold the chain's first three tokens; 2, 4 and 5 are side branches
        chain_tree = adapter.forward([prompt[-1], tokens[0], tokens[1], 7, tokens[2], 9, 11], tree).logits
        assert torch.equal(chain_tree[[0, 1, 2, 4]], steps[[0, 1, 2, 3]])
        kv.crop(adapter.cache, cached)
    prompt = chat_prompt(engine.tokenizer, f"{PASSAGE}\n\n{QUESTION}")
    plain = hasten.load(model, "autoregressive", tokenizer=engine.tokenizer).generate(prompt, max_new_tokens=64)
    assert engine.generate(prompt, max_new_tokens=64).token_ids == plain.token_ids
