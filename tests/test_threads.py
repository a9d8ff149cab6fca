"""torch's thread count: one thread by default in the library as on the command line, set only
while hasten computes (the caller's count is back between a stream's steps and after a call),
and a load that leaves nothing for the first generation to warm up."""
import os

import pytest
import torch
import transformers as tf

import hasten
from hasten.core.errors import FieldError
from hasten.core.threads import DEFAULT_THREADS, using_threads
from hasten.drafters import PromptLookup
from hasten.models import invariant
from helpers import hf_greedy, repetitive_prompt, save_checkpoint, tiny_model


@pytest.fixture
def caller_threads():
    """The caller runs torch on 2 threads (the suite runs on 1)."""
    with using_threads(2):
        yield 2


def recorded_threads(model) -> list[int]:
    """torch's thread count at each of ``model``'s forwards, as they run."""
    seen: list[int] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    return seen


def test_generate_computes_on_one_thread_and_gives_the_callers_back(caller_threads):
    model = tiny_model("llama")
    prompt = repetitive_prompt(16)
    seen = recorded_threads(model)
    out = hasten.generate(model, prompt, drafter=PromptLookup(num_tokens=4), max_new_tokens=12)
    assert DEFAULT_THREADS == 1 and seen and set(seen) == {1}
    assert torch.get_num_threads() == caller_threads
    assert out.sequences.tolist() == hf_greedy(model, prompt, 12).tolist()


@pytest.mark.parametrize("threads, expected", [(None, 2), (0, os.cpu_count()), (1, 1)])
def test_generate_threads_none_leaves_torch_alone_and_0_takes_every_core(caller_threads, threads, expected):
    model = tiny_model("llama")
    seen = recorded_threads(model)
    hasten.generate(model, repetitive_prompt(8), max_new_tokens=3, threads=threads)
    assert set(seen) == {expected} and torch.get_num_threads() == caller_threads


def test_an_engine_loads_and_generates_on_its_threads_and_a_stream_gives_them_back(tmp_path, caller_threads):
    engine = hasten.load(save_checkpoint(tmp_path), "prompt_lookup", draft_size="fixed")
    assert engine.threads == 1 and torch.get_num_threads() == caller_threads
    seen = recorded_threads(engine.model)
    for _ in engine.stream("def add(a, b):\n    return a + b\n", max_new_tokens=8):
        assert torch.get_num_threads() == caller_threads  # the consumer's code between steps
    engine.generate_batch(["def add(", "for i in"], max_new_tokens=4)
    assert seen and set(seen) == {1} and torch.get_num_threads() == caller_threads


@pytest.mark.parametrize("threads", [-1, 1.5, True])
def test_a_bad_thread_count_is_refused_naming_the_field(threads):
    with pytest.raises(FieldError, match="threads must be >= 0") as err:
        hasten.generate(tiny_model("llama"), repetitive_prompt(8), max_new_tokens=2, threads=threads)
    assert err.value.field == "threads"
    with pytest.raises(FieldError, match="threads must be"):
        hasten.load("/never/loaded", threads=threads)  # refused before any model loads


def test_load_warms_the_model_up_so_the_first_generation_pays_no_packing(tmp_path):
    """A CPU model's first forward packs its weights for hasten's kernels (hasten.models.invariant):
    on SmolLM2 the first chat's prefill cost 4x the next ones. hasten.load pays it instead."""
    config = tf.LlamaConfig(vocab_size=96, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    save_checkpoint(tmp_path / "tokenizer")  # the test tokenizer, beside the model
    engine = hasten.load(str(tmp_path), "autoregressive", tokenizer=str(tmp_path / "tokenizer"))
    if not invariant.is_prepared(engine.model):
        pytest.skip(f"hasten's kernels do not run here: {invariant.unavailable(engine.model)}")

    def packed_weights() -> list:  # each layer's packed copy, and the lean forward's fused ones
        return [id(m.__dict__.get("_packed")) for m in engine.model.modules()] + [
            id(m.__dict__.get("_hasten_invariant_fused")) for m in engine.model.modules()]

    warm = packed_weights()
    engine.generate("def add(a, b):", max_new_tokens=4)
    assert packed_weights() == warm


def test_commands_compute_on_their_threads_flag(tmp_path, cli, monkeypatch):
    """A command sets --threads for its process; the library calls inside it (hasten bench's
    timed runs) must not put their own default back."""
    from hasten.engine import loop

    seen, decode = [], loop.decode

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return (yield from decode(*args, **kwargs))

    monkeypatch.setattr(loop, "decode", recording)
    with using_threads(1):
        code, _, err = cli("bench", "--model", save_checkpoint(tmp_path / "model"), "--tasks", "complete",
                           "--per-task", "1", "--repeats", "1", "--max-new-tokens", "4", "--methods", "autoregressive",
                           "--baselines", "none", "--threads", "2", "--out", str(tmp_path / "out"), "--no-progress")
    assert code == 0, err
    assert seen and set(seen) == {2}
