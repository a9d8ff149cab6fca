"""``zoo:gec-tiny`` (Aggressive Decoding's home: a seq2seq grammar corrector), its data and the
``gec`` bench tasks: the model loads by name, ``iad`` reproduces plain greedy decoding on held-out
sentences while accepting copied drafts, and the bench runs gec tasks to their end-of-sequence."""
import random

import pytest
import torch
from transformers import AutoTokenizer

import hasten
from hasten import zoo
from hasten.bench.cli import check_workload
from hasten.bench.gec_tasks import gec_tasks
from hasten.bench.runner import hasten_method, hf_method, run_bench
from hasten.drafters import IAD
from hasten.loading import load_model
from hasten.zoo import gec

SENTENCES = 4  # held-out sentences decoded in the equality test


@pytest.fixture(scope="module")
def gec_tiny():
    model = load_model("zoo:gec-tiny")
    return model, AutoTokenizer.from_pretrained(zoo.resolve("gec-tiny"))


def test_the_zoo_model_loads_by_name_as_an_encoder_decoder(gec_tiny):
    model, tokenizer = gec_tiny
    assert model.config.is_encoder_decoder and next(model.parameters()).dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1) == (
        model.config.decoder_start_token_id, model.generation_config.eos_token_id)
    ids = tokenizer("The value is returned.").input_ids
    assert ids[-1] == tokenizer.eos_token_id  # the encoder input ends with </s>, as trained
    assert tokenizer.decode(ids, skip_special_tokens=True) == "The value is returned."


def test_iad_reproduces_plain_greedy_on_heldout_sentences_and_accepts_copies(gec_tiny):
    model, tokenizer = gec_tiny
    accepted = steps = new = 0
    for pair in gec.heldout_pairs()[:SENTENCES]:
        ids = tokenizer(pair["source"], return_tensors="pt").input_ids  # [1, T]
        plain = hasten.generate(model, ids, max_new_tokens=64)
        out = hasten.generate(model, ids, drafter=IAD(), max_new_tokens=64, draft_size="fixed")
        assert out.sequences.tolist() == plain.sequences.tolist()
        assert out.sequences[0, -1].item() == tokenizer.eos_token_id  # a finished sentence
        accepted, steps, new = accepted + out.stats.accepted_tokens, steps + out.stats.steps, new + out.stats.new_tokens
    assert accepted > 0 and new / steps > 1.5  # tau: tokens a step, well above one


def test_plain_greedy_corrects_or_copies_text(gec_tiny):
    """Behaviour, not a score: the model's output is text close to its input (a corrector, not a
    generator), here on a sentence with one typo and a clean sentence."""
    model, tokenizer = gec_tiny
    for text in ("The default value is returned if the key is not found.",
                 "The defualt value is returned if the key is not found."):
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = tokenizer.decode(hasten.generate(model, ids, max_new_tokens=64).sequences[0], skip_special_tokens=True)
        shared = set(out.split()) & set(text.split())
        assert len(shared) >= len(text.split()) - 2


def test_the_heldout_set_ships_and_never_overlaps_training():
    pairs = gec.heldout_pairs()
    assert len(pairs) == gec.HELDOUT_SHIPPED
    assert all(gec.is_heldout(p["target"]) for p in pairs)  # the hash split keeps them out of training
    assert sum(p["source"] != p["target"] for p in pairs) > len(pairs) // 2
    assert all(set(p["edits"]) <= set(gec.EDITS) for p in pairs)


def test_corruptions_are_deterministic_and_of_the_named_kinds():
    sentence = "The value of the attribute is returned when the object has been created."
    first = [gec.corrupt(sentence, random.Random(seed)) for seed in range(30)]
    assert first == [gec.corrupt(sentence, random.Random(seed)) for seed in range(30)]
    kinds = {kind for _, made in first for kind in made}
    assert kinds == set(gec.EDITS)
    assert any(text == sentence and not made for text, made in first)  # some sentences stay correct
    for kind, edit in gec.EDITS.items():
        words = sentence.split(" ")
        assert edit(words, random.Random(0)) and " ".join(words) != sentence, kind


def test_gec_tasks_load_and_the_bench_runs_them_to_eos(gec_tiny):
    model, tokenizer = gec_tiny
    check_workload(type("Args", (), {"tasks": "gec", "per_task": 2, "max_new_tokens": 8, "threads": 1})())
    tasks = gec_tasks(tokenizer, per_task=2)
    pairs = gec.heldout_pairs()
    assert [t.prompt for t in tasks] == [p["source"] for p in pairs[:2]]
    assert all(t.category == "gec" and t.stop_at_eos and t.prompt_tokens > 5 for t in tasks)
    with pytest.raises(ValueError, match="per-task"):
        gec_tasks(tokenizer, per_task=len(pairs) + 1)
    input_ids = [tokenizer(t.prompt, return_tensors="pt").input_ids for t in tasks]
    methods = [hasten_method("autoregressive", model), hasten_method("iad", model, draft_size="fixed"),
               hf_method("hf_generate", model)]
    result = run_bench(methods, tasks, input_ids, max_new_tokens=64, repeats=1, progress=False)
    for entry in result["by_task"]:
        rows = {row["method"]: row for row in entry["rows"]}
        assert all(row["identical"] == "1/1" for row in rows.values())  # HF's generate too: same tokens
        assert rows["autoregressive"]["tokens"] < 64  # stopped at </s>


def test_the_shipped_gad_drafter_reads_the_source_and_reproduces_plain_greedy(gec_tiny):
    """``zoo:gec-tiny`` ships the drafter ``hasten train gad --model zoo:gec-tiny`` trained
    (src/hasten/zoo/weights/gec-tiny/gad/): found beside the model, it cross-attends to the
    encoder's states, and its drafts are accepted while the output stays plain greedy's."""
    from hasten.drafters import GAD

    model, tokenizer = gec_tiny
    accepted = steps = new = 0
    for pair in gec.heldout_pairs()[:SENTENCES]:
        ids = tokenizer(pair["source"], return_tensors="pt").input_ids  # [1, T]
        drafter = GAD(require_weights=True)
        out = hasten.generate(model, ids, drafter=drafter, max_new_tokens=64, draft_size="fixed")
        assert out.sequences.tolist() == hasten.generate(model, ids, max_new_tokens=64).sequences.tolist()
        accepted, steps, new = accepted + out.stats.accepted_tokens, steps + out.stats.steps, new + out.stats.new_tokens
    assert drafter.module.config.encoder_size == model.config.d_model
    assert accepted > 0 and new / steps > 1.5
