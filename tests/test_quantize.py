"""Quantized targets: hasten's contract holds relative to the quantized model the user runs.

An int8 model gives each token of a block exactly the logits it gets alone (one activation
scale per token, exact integer products), so greedy output with any drafter equals Hugging
Face ``generate`` on the same int8 model, and sampling follows its law."""
import copy

import pytest
import torch

import hasten
from hasten.core.sampling import Sampling
from hasten.drafters import DraftModel, Lookahead, PromptLookup
from hasten.models.adapter import ModelAdapter
from hasten.models.quantize import Int8Linear, is_quantized, quantize
from helpers import hf_greedy, repetitive_prompt, tiny_model
from test_sampling_distribution import exact_law, peaky_model, sampled_law_tv
from test_verify_law import bound

NEW = 32
LAW_SAMPLES = 400  # a loose bound, but the sampler itself is tested elsewhere: this checks the int8 target under it


def test_a_rows_result_does_not_depend_on_the_other_rows():
    torch.manual_seed(0)
    layer = Int8Linear.of(torch.nn.Linear(48, 40))
    rows = torch.randn(7, 48) * torch.logspace(-2, 2, 7)[:, None]  # rows of very different ranges
    together = layer(rows)  # [7, 40]
    alone = torch.cat([layer(row[None]) for row in rows])
    assert torch.equal(together, alone)


def test_int8_linear_stays_close_to_the_float_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(5, 3, 64)
    expected = linear(x)
    got = Int8Linear.of(linear)(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()  # 7-bit activations (reduce_range)
    torch.testing.assert_close(Int8Linear.of(linear).weight, linear.weight, atol=linear.weight.abs().max() / 120,
                               rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_every_linear_layer_is_replaced(arch):
    model = quantize(tiny_model(arch), "int8")
    assert is_quantized(model)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert model.dtype == torch.float32 and model.device.type == "cpu"  # what the adapter reads


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("method", ["plain", "prompt_lookup", "lookahead", "draft_model"])
def test_int8_greedy_equals_hf_generate_on_the_int8_model(arch, method):
    model = quantize(tiny_model(arch), "int8")
    drafter = {"plain": lambda: None, "prompt_lookup": lambda: PromptLookup(num_tokens=4),
               "lookahead": lambda: Lookahead(),
               "draft_model": lambda: DraftModel(quantize(tiny_model(arch, seed=3), "int8"), num_tokens=4)}[method]()
    for seed in range(3):
        prompt = repetitive_prompt(24, seed=seed)
        reference = hf_greedy(model, prompt, NEW)
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW)
        assert out.sequences.tolist() == reference.tolist(), f"seed {seed}"


def test_a_block_gets_the_logits_of_one_token_steps_after_int8():
    """What greedy equality rests on: verifying a block gives each token the logits it gets
    when decoded alone, up to float32 attention rounding (1e-7 here). One activation scale
    per tensor (torch.ao's quantize_dynamic) misses by about 6e-3 on this model."""
    model = quantize(tiny_model("llama"), "int8")
    prompt = repetitive_prompt(24)[0].tolist()
    block_run, step_run = ModelAdapter(model), ModelAdapter(model)
    block_run.start(torch.tensor([prompt[:16]]))
    step_run.start(torch.tensor([prompt[:16]]))
    block = block_run.forward(prompt[15:], tree=None).logits  # [9, vocab]
    steps = torch.cat([step_run.forward([token], tree=None).logits for token in prompt[15:]])
    torch.testing.assert_close(block, steps, rtol=0, atol=1e-6)


def test_bfloat16_greedy_equals_hf_generate_on_the_bfloat16_model():
    model = quantize(tiny_model("llama"), "bfloat16")
    assert model.dtype == torch.bfloat16
    prompt = repetitive_prompt(24)
    reference = hf_greedy(model, prompt, NEW)
    out = hasten.generate(model, prompt, drafter=PromptLookup(num_tokens=4), max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()


def test_int8_sampling_with_an_int8_draft_follows_the_int8_target():
    target = quantize(peaky_model(0), "int8")
    drafter = DraftModel(quantize(peaky_model(5), "int8"), num_tokens=2)
    sampling = Sampling(1.0)
    tv = sampled_law_tv(target, drafter, sampling, 2, 2, LAW_SAMPLES)
    limit = bound(exact_law(target, sampling, 2), LAW_SAMPLES)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


def test_a_copied_int8_model_computes_the_same_logits():
    model = quantize(tiny_model("llama"), "int8")
    twin = copy.deepcopy(model)
    prompt = repetitive_prompt(24)
    assert torch.equal(twin(prompt).logits, model(prompt).logits)


def test_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="int8, bfloat16"):
        quantize(tiny_model("llama"), "int4")


@pytest.mark.real
def test_smollm2_int8_greedy_equals_hf_generate_on_the_int8_model():
    from hasten.loading import load_model, load_tokenizer
    from hasten.bench.chat_tasks import chat_input_ids, chat_tasks
    from hasten.zoo import real

    path = str(real.resolve("smollm2-135m"))
    model, tokenizer = quantize(load_model(path), "int8"), load_tokenizer(path)
    for task in chat_tasks(tokenizer, ("rag", "grammar"), per_task=1):
        prompt = chat_input_ids(tokenizer, task.messages)
        reference = model.generate(prompt, do_sample=False, max_new_tokens=64, eos_token_id=None, pad_token_id=0)
        out = hasten.generate(model, prompt, drafter=PromptLookup(), max_new_tokens=64, eos_token_id=[])
        assert out.sequences.tolist() == reference.tolist(), task.name


def test_an_int8_model_gets_its_own_cost_calibration():
    from hasten.engine.calibration import calibration_key

    model = tiny_model("llama")
    assert calibration_key(quantize(copy.deepcopy(model), "int8")) != calibration_key(model)
