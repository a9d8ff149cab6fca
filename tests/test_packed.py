"""hasten's forwards on packed weights (models/packed.py): prefills, one-token steps and blocks
take the packed kernel, the same model outside hasten keeps ``F.linear``'s bits, and outputs stay
the model's."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hasten
from hasten.drafters import PromptLookup
from hasten.models import packed
from hasten.models.adapter import ModelAdapter
from hasten.models.hf import HuggingFaceRuntime
from hasten.models.quantize import quantize
from helpers import DEVICE, ScriptedDrafter, generate_exactly, hf_greedy, repetitive_prompt, tiny_model

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu" or not packed.supported(),
                                reason="the packed path is for float32 models on a CPU with oneDNN")


@pytest.fixture(autouse=True)
def pack_tiny_layers(monkeypatch):
    """The tiny models' layers are below the size worth packing; here they are packed anyway."""
    monkeypatch.setattr(packed, "MIN_PACKED_WEIGHTS", 0)


def linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


class CountPacked:
    """Counts the packed kernel's calls."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = packed.packed_linear

        def counted(*args):
            self.calls += 1
            return real(*args)

        monkeypatch.setattr(packed, "packed_linear", counted)


def test_a_float32_cpu_model_gets_the_packed_class_once_and_keeps_its_parameters():
    model = tiny_model("llama")
    before = {name: p.clone() for name, p in model.state_dict().items()}
    assert HuggingFaceRuntime(model).packed_weights
    assert all(type(m) is packed.PackedLinear for m in linears(model))
    assert packed.prepare(model)  # again: nothing changes
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
    key = HuggingFaceRuntime(model).cost_key()
    assert key["linear"] == ["PackedLinear"]  # the cost curve is measured anew for the packed path


def test_off_by_environment_and_for_other_dtypes_and_replaced_layers(monkeypatch):
    monkeypatch.setenv("HASTEN_PACKED_BLOCKS", "0")
    model = tiny_model("llama")
    assert not HuggingFaceRuntime(model).packed_weights and all(type(m) is nn.Linear for m in linears(model))
    monkeypatch.delenv("HASTEN_PACKED_BLOCKS")
    assert not packed.prepare(tiny_model("llama").to(torch.bfloat16))
    int8 = quantize(tiny_model("llama"), "int8")
    packed.prepare(int8)
    assert not any(type(m) is packed.PackedLinear for m in int8.modules())


def test_small_layers_keep_f_linear(monkeypatch):
    monkeypatch.setattr(packed, "MIN_PACKED_WEIGHTS", 1 << 16)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 255))  # 65,536 weights and one row fewer
    assert packed.prepare(model)
    assert [type(m) for m in model] == [packed.PackedLinear, nn.Linear]
    assert not packed.prepare(tiny_model("llama"))


def test_inside_hasten_every_row_count_is_packed_and_outside_it_is_f_linear_bit_for_bit():
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    reference = nn.Linear(64, 48)
    reference.load_state_dict(layer.state_dict())
    assert packed.prepare(layer)
    x = torch.randn(1, 6, 64)  # [batch, rows, in]
    with packed.active():
        one, block = layer(x[:, :1]), layer(x)
    assert torch.equal(layer(x), F.linear(x, reference.weight, reference.bias))  # outside: F.linear
    with packed.active(False):
        assert torch.equal(layer(x), F.linear(x, reference.weight, reference.bias))
    for inputs, result in ((x[:, :1], one), (x, block)):
        assert torch.equal(result, packed.packed_linear(inputs, layer.packed_weight(), layer.bias))
        assert torch.allclose(result, F.linear(inputs, reference.weight, reference.bias), atol=1e-5)


def test_a_changed_weight_is_packed_again():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    packed.prepare(layer)
    x = torch.randn(4, 16)
    with packed.active():
        first = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)
        second = layer(x)
    assert torch.allclose(second - layer.bias, 2 * (first - layer.bias), atol=1e-5)


def test_the_prefill_runs_packed_and_gives_the_models_logits_within_rounding(monkeypatch):
    model = tiny_model("llama")
    HuggingFaceRuntime(model)
    counter = CountPacked(monkeypatch)
    prompt = repetitive_prompt(24)
    adapter = ModelAdapter(model)
    adapter.start(prompt, logits=True)
    assert counter.calls > 0
    calls = counter.calls
    with torch.no_grad():
        own = model(prompt[:, :-1]).logits[0]  # outside hasten: F.linear
    assert counter.calls == calls
    assert torch.allclose(adapter.prompt_logits, own, atol=1e-4)
    assert adapter.prompt_logits.argmax(-1).tolist() == own.argmax(-1).tolist()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
@pytest.mark.parametrize("mode", ["oracle", "adversarial", 2])  # every draft right, every one wrong, the third wrong
def test_greedy_output_is_the_models_on_packed_weights(arch, mode, monkeypatch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(32)
    reference = hf_greedy(model, prompt, 40)
    counter = CountPacked(monkeypatch)
    stats = generate_exactly(model, prompt, reference, ScriptedDrafter(reference[0].tolist(), 6, mode), 40)
    assert counter.calls > 0  # the forwards went through the packed kernel
    assert (stats.accepted_tokens > 0) == (mode != "adversarial")


def test_prompt_lookup_keeps_the_models_output_on_packed_weights(monkeypatch):
    model = tiny_model("llama")
    prompt = repetitive_prompt(32)
    counter = CountPacked(monkeypatch)
    out = hasten.generate(model, prompt, drafter=PromptLookup(), max_new_tokens=40, draft_size="fixed")
    assert counter.calls > 0 and torch.equal(out.sequences, hf_greedy(model, prompt, 40))


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_plain_decoding_runs_packed_and_keeps_generates_tokens(arch, monkeypatch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(32)
    counter = CountPacked(monkeypatch)
    out = hasten.generate(model, prompt, max_new_tokens=40)
    assert counter.calls > 0 and torch.equal(out.sequences, hf_greedy(model, prompt, 40))


def test_a_model_prepared_before_stays_prepared_however_little_memory_is_left(monkeypatch):
    model = tiny_model("llama")
    assert packed.prepare(model)
    monkeypatch.setattr(packed, "_available_bytes", lambda: 0)  # the copies made since took the room
    assert packed.prepare(model) and HuggingFaceRuntime(model).packed_weights
    assert not packed.prepare(tiny_model("llama", seed=1))  # a new model does not fit


def test_sampled_output_follows_the_target_with_blocks_on_packed_weights(monkeypatch):
    """The end-to-end sampling law (test_sampling_distribution.py) with the target's blocks on
    packed weights: a fixed tree with siblings 3 deep, so drafts are accepted and rejected at
    depths 1 to 3; the exact law is the model's own forward (F.linear)."""
    from test_sampling_distribution import TARGET, TREE_SAMPLING, RankedTreeDrafter, deep_tv

    assert packed.prepare(TARGET)
    try:
        counter = CountPacked(monkeypatch)
        tv, limit = deep_tv(RankedTreeDrafter(TARGET, TREE_SAMPLING), TREE_SAMPLING)
        assert counter.calls > 0
        assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"
    finally:  # TARGET is shared with other test files: give it back its own class
        for module in TARGET.modules():
            if type(module) is packed.PackedLinear:
                module.__class__ = nn.Linear
