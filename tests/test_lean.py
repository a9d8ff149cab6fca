"""The leaner Llama-family forward (models/lean.py): the model's own logits bit for bit, on
every kind of forward hasten runs, and the model's own forward wherever it does not apply."""
import pytest
import torch
from torch import nn

import hasten
from hasten.core.tree import TokenTree
from hasten.drafters import PromptLookup
from hasten.models import cache as kv
from hasten.kernels import ops
from hasten.models import forwards, invariant, lean
from hasten.models.adapter import ModelAdapter
from hasten.models.layers import last_queries
from helpers import DEVICE, ScriptedDrafter, generate_exactly, hf_greedy, repetitive_prompt, tiny_model

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the lean forward is for float32 models on the CPU")

TREE = TokenTree((-1, 0, 1, 0, -1, 4))  # six nodes: siblings at depths 1 and 2


class CountLean:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = lean.forward

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(lean, "forward", counted)


def run(model, prompt, blocks, use_lean: bool, monkeypatch, hidden: bool = False) -> list[torch.Tensor]:
    """The prefill's logits, then each (block, tree)'s logits after it, rolled back between blocks;
    ``hidden``: each forward's last hidden states (the features drafters read) after its logits."""
    monkeypatch.setenv("HASTEN_LEAN_FORWARD", "1" if use_lean else "0")
    adapter = ModelAdapter(model)
    assert (adapter._lean_modules is not None) == use_lean
    _, states = adapter.start(prompt, hidden=hidden, logits=True)
    results = [adapter.prompt_logits, *([states] if hidden else [])]
    for block, tree in blocks:
        out = adapter.forward(block, tree, hidden=hidden)
        results += [out.logits, *([out.hidden] if hidden else [])]
        kv.crop(adapter.cache, prompt.shape[1] - 1)
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("hidden", [False, True], ids=["logits", "with-hidden-states"])
def test_every_forward_equals_the_models_own_bit_for_bit(arch, dtype, hidden, monkeypatch):
    """Logits, and where asked the last hidden states (Medusa's, EAGLE's and Chimera's features)."""
    model = tiny_model(arch).to(getattr(torch, dtype))
    assert invariant.prepare(model)  # the lean forward runs on hasten's kernels (models/invariant.py)
    prompt = repetitive_prompt(40)
    root = int(prompt[0, -1])
    blocks = [([root], None), ([root, 5, 6, 7, 8, 9, 10], None), ([root, *range(10, 16)], TREE)]
    counter = CountLean(monkeypatch)
    own = run(model, prompt, blocks, False, monkeypatch, hidden)
    assert counter.calls == 0
    leaner = run(model, prompt, blocks, True, monkeypatch, hidden)
    assert counter.calls == 1 + len(blocks)  # the prefill and every block
    assert len(own) == len(leaner) == (1 + len(blocks)) * (2 if hidden else 1)
    for a, b in zip(own, leaner):
        assert a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["oracle", "adversarial", 2])
def test_greedy_output_is_generates_through_the_lean_forward(arch, mode, monkeypatch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(32)
    reference = hf_greedy(model, prompt, 40)
    counter = CountLean(monkeypatch)
    generate_exactly(model, prompt, reference, ScriptedDrafter(reference[0].tolist(), 6, mode), 40)
    out = hasten.generate(model, prompt, drafter=PromptLookup(), max_new_tokens=40)
    assert torch.equal(out.sequences, reference)
    assert counter.calls > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [32, 576, 896, 2048])
def test_the_norm_kernel_is_transformers_formula_each_row_alone_with_the_residual_add_exact(hidden, dtype):
    """The CPU norm (ops.rms_norm: the lean forward's and the prepared model's own) is
    transformers' weight * (x * rsqrt(mean(x^2) + eps)) up to the order of its sum of squares:
    within a rounding of the formula, each row's bits the same alone or among others, and the
    residual add it carries is PyTorch's add bit for bit."""
    torch.manual_seed(hidden)
    weight = (torch.randn(hidden) * 0.2 + 1).to(dtype)
    x, delta = (torch.randn(300, hidden) * 3).to(dtype), torch.randn(300, hidden).to(dtype)
    out, stream = ops.rms_norm(x, weight, 1e-6, delta)
    assert out.dtype == dtype and torch.equal(stream, x + delta)
    h = stream.float()
    written = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    step = 1e-6 if dtype == torch.float32 else 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10  # a rounding, relative
    assert torch.allclose(out.float(), written.float(), rtol=2 * step, atol=1e-6)
    for rows in ((0, 1), (5, 12), (299, 300)):
        alone, alone_stream = ops.rms_norm(x[rows[0]:rows[1]], weight, 1e-6, delta[rows[0]:rows[1]])
        assert torch.equal(alone, out[rows[0]:rows[1]]) and torch.equal(alone_stream, stream[rows[0]:rows[1]])
    plain, same = ops.rms_norm(stream, weight, 1e-6)
    assert torch.equal(plain, out) and same is stream


def test_a_prepared_models_own_norm_runs_the_kernel_inside_hasten_and_transformers_formula_outside():
    """The model's own forward (taken where drafters hook the model) must norm as the lean one
    does: inside hasten's forwards its norm modules run the kernel; outside, transformers' code."""
    norm = prepared("llama").model.norm
    torch.manual_seed(5)
    x = torch.randn(1, 64, norm.weight.shape[0]) * 3  # [1, rows, hidden]
    kernel = ops.rms_norm(x[0], norm.weight, norm.variance_epsilon)[0]
    formula = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    assert not torch.equal(kernel, formula[0])  # the two orders of the sum differ somewhere here
    with forwards.active():
        assert torch.equal(norm(x)[0], kernel)
    assert torch.equal(norm(x), formula)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rotary_kernel_gives_pytorchs_bits(dtype):
    """ops.rotary is transformers' x * cos + rotate_half(x) * sin operation for operation, each
    rounded as PyTorch's CPU operators round it: the same bits, on strided views too."""
    torch.manual_seed(1)
    qkv = torch.randn(37, 15, 64).to(dtype)  # [rows, heads, D]
    angles = torch.randn(37, 64) * 40
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, :11]  # a view: the row stride is the packed product's
    half = torch.cat((-qk[..., 32:], qk[..., :32]), dim=-1)
    assert torch.equal(ops.rotary(qk, cos, sin), qk * cos[:, None] + half * sin[:, None])
    with pytest.raises(ValueError, match="cos/sin"):
        ops.rotary(qk, cos[:, :32], sin[:, :32])


def prepared(arch: str):
    model = tiny_model(arch)
    assert invariant.prepare(model)
    return model


def test_where_it_does_not_apply_the_models_own_forward_runs(monkeypatch):
    assert not lean.eligible(prepared("gpt2"))
    assert not lean.eligible(prepared("mistral"))  # sliding windows
    assert not lean.eligible(tiny_model("llama"))  # only on hasten's kernels: once invariant.prepare ran
    monkeypatch.setenv("HASTEN_LEAN_FORWARD", "0")
    assert not lean.eligible(prepared("llama"))
    monkeypatch.delenv("HASTEN_LEAN_FORWARD")
    model = prepared("llama")
    modules = list(model.modules())
    assert lean.eligible(model) and lean.usable(model, modules) and not lean.usable(model, None)
    model.train()
    assert not lean.usable(model, modules)
    model.eval()
    with last_queries(model) as queries:  # query capture runs the model's own attention
        assert not lean.usable(model, modules)
        ModelAdapter(model).start(repetitive_prompt(8))
    assert queries and lean.usable(model, modules)


def test_the_cost_key_tells_lean_forwards_apart(monkeypatch):
    """Cost-aware sizing keeps a cost curve per key: one measured on the model's own forward
    must not be used for the leaner one."""
    from hasten.models.hf import HuggingFaceRuntime

    assert HuggingFaceRuntime(tiny_model("llama")).cost_key()["lean_forward"]
    monkeypatch.setenv("HASTEN_LEAN_FORWARD", "0")
    assert not HuggingFaceRuntime(tiny_model("llama")).cost_key()["lean_forward"]


def test_a_hooked_model_runs_its_own_forward_so_the_hook_sees_every_forward(monkeypatch):
    model = tiny_model("llama")
    prompt = repetitive_prompt(24)
    seen = []
    handle = model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(args[0].shape[1]))
    counter = CountLean(monkeypatch)
    try:
        out = hasten.generate(model, prompt, drafter=PromptLookup(), max_new_tokens=12)
    finally:
        handle.remove()
    assert counter.calls == 0 and seen[0] == prompt.shape[1] - 1 and len(seen) == 1 + out.stats.steps  # the prefill, then every step
    assert torch.equal(out.sequences, hf_greedy(model, prompt, 12))
    assert not lean.hooked(list(model.modules()))
    handle = nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert lean.hooked(list(model.modules()))
    finally:
        handle.remove()
