"""The Runtime protocol: every registered drafter on each runtime generates or refuses with one
error naming the missing capability, before any forward; the documented one-file runtime
runs; and no code above the models floor probes a model object to decide what it is."""
import re
from pathlib import Path

import pytest
import torch
import transformers as tf

import hasten
from hasten.core.runtime import Capability, MissingCapability, Runtime
from hasten.drafters import REGISTRY, PromptLookup, create
from hasten.drafters.base import TargetView, UndeclaredNeed
from hasten.models.hf import HuggingFaceRuntime, runtime_of
from hasten.models.layers import model_name
from hasten.models.llamacpp import LlamaCppModel
from helpers import VOCAB, _COMMON, hf_greedy, repetitive_prompt, tiny_model

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "architecture.md"
NEW = 10


def tiny_falcon():
    """Falcon's attention does not go through transformers' attention interface."""
    torch.manual_seed(0)
    config = tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **_COMMON)
    return tf.FalconForCausalLM(config).eval()


def drafter_for(name: str, model):
    return create(name, model=model) if REGISTRY[name].needs_draft_model else create(name)


@pytest.fixture(scope="module")
def targets():
    return {"llama": tiny_model("llama"), "falcon": tiny_falcon()}


@pytest.mark.filterwarnings("ignore::hasten.HastenWarning")  # untrained drafters: warned about elsewhere
@pytest.mark.parametrize("arch", ["llama", "falcon"])
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_drafter_on_hugging_face_generates_or_refuses_by_capability(targets, arch, name):
    model = targets[arch]
    runtime = runtime_of(model)
    prompt = repetitive_prompt(12, seed=3)
    missing = REGISTRY[name].needs - runtime.capabilities
    if missing:
        with pytest.raises(MissingCapability) as refusal:
            hasten.generate(model, prompt, drafter=drafter_for(name, model), max_new_tokens=NEW)
        assert refusal.value.field == "method" and refusal.value.missing == missing
        assert all(str(capability) in str(refusal.value) for capability in missing)
        return
    try:
        out = hasten.generate(model, prompt, drafter=drafter_for(name, model), max_new_tokens=NEW)
    except ValueError as err:  # this architecture, not this runtime: one line that names it
        assert "\n" not in str(err) and model_name(model) in str(err), err
        return
    assert out.sequences.tolist() == hf_greedy(model, prompt, NEW).tolist()


def test_triforce_on_falcon_is_refused_for_query_capture(targets):
    with pytest.raises(MissingCapability, match="triforce needs query capture, which the Hugging Face runtime"):
        hasten.generate(targets["falcon"], repetitive_prompt(12), drafter=create("triforce", model=targets["falcon"]),
                        max_new_tokens=4)
    assert Capability.QUERY_CAPTURE in runtime_of(targets["llama"]).capabilities


def llama_cpp_declarations() -> type[LlamaCppModel]:
    """What the llama.cpp runtime declares, without loading a file (its capabilities, name
    and kind are class attributes)."""
    return LlamaCppModel


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_drafter_on_llama_cpp_is_refused_by_capability_or_allowed(name):
    runtime = llama_cpp_declarations()
    needs = REGISTRY[name].needs
    if not needs:
        REGISTRY[name].check_runtime(runtime)
        return
    with pytest.raises(MissingCapability) as refusal:
        REGISTRY[name].check_runtime(runtime)
    assert refusal.value.missing == needs and "llama.cpp runtime" in str(refusal.value)


def test_longspec_on_llama_cpp_names_what_it_lacks():
    with pytest.raises(MissingCapability, match="longspec needs KV read-back, torch modules, which the llama.cpp"):
        REGISTRY["longspec"].check_runtime(llama_cpp_declarations())


def test_runtime_of_takes_models_and_runtimes_only():
    model = tiny_model("llama")
    runtime = runtime_of(model)
    assert isinstance(runtime, HuggingFaceRuntime) and runtime.vocab_size == VOCAB
    assert runtime_of(runtime) is runtime
    with pytest.raises(TypeError, match="PreTrainedModel or a hasten Runtime"):
        runtime_of(object())
    with pytest.raises(TypeError, match="PreTrainedModel or a hasten Runtime"):
        hasten.generate(object(), torch.tensor([[1, 2]]))


def documented_runtime() -> dict:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    code = next(block for block in blocks if "class Recompute(Runtime)" in block)
    namespace: dict = {}
    exec(compile(code, str(PAGE), "exec"), namespace)
    return namespace


def test_the_documented_runtime_decodes_losslessly_and_refuses_by_capability():
    Recompute = documented_runtime()["Recompute"]
    model = tiny_model("qwen2")
    prompt = repetitive_prompt(16, seed=5)
    runtime = Recompute(model)
    assert isinstance(runtime, Runtime) and runtime.capabilities == frozenset()
    for drafter in (None, PromptLookup(num_tokens=4), create("lookahead")):
        out = hasten.generate(runtime, prompt, drafter=drafter, max_new_tokens=16)
        assert out.sequences.tolist() == hf_greedy(model, prompt, 16).tolist()
    assert hasten.generate(runtime, prompt, drafter=PromptLookup(num_tokens=4), max_new_tokens=16).stats.drafted_tokens
    with pytest.raises(MissingCapability, match="medusa needs hidden states, torch modules, which the recompute"):
        hasten.generate(runtime, prompt, drafter=create("medusa"), max_new_tokens=4)


# an attribute probe of a model, its config or its layers, a target or a runtime (models/ answers those)
PROBE = re.compile(r"\b(?:hasattr|getattr)\([^,]*\b(?:model|target|config|layers?|base|runtime)\b[^,]*,")


def test_no_attribute_probe_of_a_model_or_target_decides_behaviour():
    """The engine, the drafters and the API ask runtimes and declared attributes, never
    ``hasattr(model, ...)`` (the runtime adapters in models/ are where model differences live)."""
    found = []
    for folder in ("engine", "drafters"):
        for path in sorted((ROOT / "src" / "hasten" / folder).glob("*.py")):
            found += [f"{path.name}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if PROBE.search(line)]
    api = ROOT / "src" / "hasten" / "api.py"
    found += [f"api.py:{i}" for i, line in enumerate(api.read_text().splitlines(), 1) if PROBE.search(line)]
    assert found == []


class ReadsModulesUndeclared(PromptLookup):
    """A drafter that borrows the target's modules without declaring Capability.MODULES."""

    def begin(self, ctx):
        return ctx.target.modules


def test_drafters_see_a_view_that_lends_only_what_they_declare():
    """``ctx.target`` is a TargetView: no forward, commit or crop of the loop's cache exists on
    it, and each capability's reads answer only when the drafter declared that capability."""
    model = tiny_model("llama")
    session = runtime_of(model).session()
    tokens, _ = session.start(repetitive_prompt(10))
    bare = TargetView(session, frozenset())
    assert [name for name in ("forward", "forward_rows", "crop", "commit", "start", "cache", "model")
            if hasattr(bare, name)] == []
    assert (bare.vocab_size, bare.encoder_decoder, bare.cache_length) == (VOCAB, False, len(tokens) - 1)
    for read in (lambda v: v.modules, lambda v: v.read_kv(-1), lambda v: v.probe_queries(tokens[-1])):
        with pytest.raises(UndeclaredNeed):
            read(bare)
    lent = TargetView(session, frozenset({Capability.MODULES, Capability.KV_READ, Capability.QUERY_CAPTURE}))
    assert lent.modules is model and lent.kv_readable
    assert torch.equal(lent.read_kv(-1)[0], session.read_kv(-1)[0])
    row, _ = runtime_of(model).batch(2).add([1, 2, 3])
    assert not TargetView(row, frozenset({Capability.KV_READ})).kv_readable  # a batch row's cache is shared
    with pytest.raises(UndeclaredNeed, match="torch modules"):
        hasten.generate(model, repetitive_prompt(10), drafter=ReadsModulesUndeclared(), max_new_tokens=4)


def test_a_query_probe_leaves_the_cache_as_it_was():
    model = tiny_model("llama")
    session = runtime_of(model).session()
    tokens, _ = session.start(repetitive_prompt(10))
    keys, values = (t.clone() for t in session.read_kv(-1))
    queries = session.probe_queries(tokens[-1])
    assert sorted(queries) == list(range(model.config.num_hidden_layers))
    assert all(q.shape == (model.config.num_attention_heads, 1, 8) for q in queries.values())  # [heads, 1, head_dim]
    assert session.cache_length == len(tokens) - 1
    assert torch.equal(session.read_kv(-1)[0], keys) and torch.equal(session.read_kv(-1)[1], values)
    assert session.kv_readable and not runtime_of(model).batch(2).add([1, 2, 3])[0].kv_readable


def test_prompt_log_probabilities_need_a_runtime_that_keeps_the_prefills_logits():
    """Capability.PROMPT_LOGITS: declared by the Hugging Face runtime (its batch keeps the prefill's
    logits); a runtime without it refuses prompt_logprobs by name, before any forward."""
    from hasten.core.errors import FieldError
    from hasten.core.runtime import Capability
    from hasten.engine.batch import Request, Scheduler

    scheduler = Scheduler(tiny_model("llama"), None, max_batch=2)
    assert Capability.PROMPT_LOGITS in scheduler.runtime.capabilities
    scheduler.runtime.capabilities = scheduler.runtime.capabilities - {Capability.PROMPT_LOGITS}
    with pytest.raises(FieldError, match="prefill's logits") as refused:
        scheduler.submit(Request([5, 6, 7], 4, prompt_logprobs=1))
    assert refused.value.field == "prompt_logprobs"
    scheduler.submit(Request([5, 6, 7], 4))  # a request that asks for none is served
