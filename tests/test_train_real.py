"""Training drafters for the packaged real models: chat-formatted self-distillation, the
prompt text shipped with Python, and where `--method medusa|eagle` finds the modules
shipped for a packaged model (a GGUF dequantised into the cache, not a zoo directory)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hasten
from hasten.drafters.eagle import Eagle
from hasten.drafters.medusa import Medusa, MedusaHeads
from hasten.training.distill import INSTRUCTIONS, DistillSettings, distill, pydoc_documents
from hasten.zoo import real
from hasten.zoo.packing import unpacked
from helpers import TRAIN_TEXT, save_checkpoint, tiny_model, tiny_tokenizer
from hasten.core.errors import HastenWarning

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = DistillSettings(samples=5, prompt_tokens=6, gen_tokens=10, chat=True)
MODEL = tiny_model("llama")


def chat_tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


# ---- chat-formatted distillation ----------------------------------------------------------------
def test_chat_distillation_asks_for_a_task_on_each_window_and_labels_only_the_answer(tmp_path):
    tokenizer = chat_tokenizer()
    data = distill(MODEL, tokenizer, TRAIN_TEXT, CHAT, tmp_path, source="test", progress=False)
    assert len(data) == CHAT.samples
    def shown(text: str) -> str:  # the tiny tokenizer drops characters it never saw: compare what it keeps
        return tokenizer.decode(tokenizer(text, add_special_tokens=False).input_ids)

    asked = set()
    for row in range(len(data)):
        length, prompt = int(data.lengths[row]), int(data.prompt_lengths[row])
        text = tokenizer.decode(data.ids[row, :prompt])
        # one user message under the template, asking for one of the tasks; the assistant's turn opened
        instructions = [i for i in INSTRUCTIONS if text.startswith(shown(f"<user>{i}\n\n"))]
        assert len(instructions) == 1 and text.endswith(shown("\n<assistant>")), text
        asked.add(instructions[0])
        # the answer is the target's own greedy continuation, stopped by its EOS
        expected = hasten.generate(MODEL, data.ids[row, :prompt][None], max_new_tokens=CHAT.gen_tokens,
                                   eos_token_id=MODEL.generation_config.eos_token_id).sequences
        assert torch.equal(data.ids[row, :length], expected[0])
        mask = data.batch(torch.tensor([row]), MODEL).label_mask[0]  # [T]
        assert mask[:prompt].sum() == 0 and bool(mask[prompt:length].all())
    assert len(asked) > 1  # instructions are drawn, not fixed
    # a resumed run reads back the per-row prompt lengths
    again = distill(MODEL, tokenizer, TRAIN_TEXT, CHAT, tmp_path, source="test", resume=True, progress=False)
    assert torch.equal(again.prompt_lengths, data.prompt_lengths) and torch.equal(again.ids, data.ids)


def test_chat_distillation_needs_a_chat_template(tmp_path):
    with pytest.raises(ValueError, match="chat template"):
        distill(MODEL, tiny_tokenizer(), TRAIN_TEXT, CHAT, tmp_path, source="test", progress=False)


def test_python_reference_text_is_english_prose():
    documents = pydoc_documents()
    assert len(documents) > 50
    text = " ".join(documents)
    assert len(text) > 100_000 and text.count(" the ") > 1000


def test_hasten_train_takes_pydoc_topics_and_chat_flags():
    from argparse import ArgumentParser

    from hasten.training.cli import add_arguments

    parser = ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["medusa", "--model", "m", "--out", "o", "--pydoc-topics", "--chat"])
    assert args.pydoc_topics and args.chat and not args.zoo_corpus
    with pytest.raises(SystemExit):  # one text source at a time
        parser.parse_args(["medusa", "--model", "m", "--out", "o", "--pydoc-topics", "--zoo-corpus"])


# ---- where the modules of a packaged model are found ------------------------------------------------
def dequantised_copy(directory: Path, gguf_name: str, gguf_bytes: int) -> Path:
    """A tiny checkpoint laid out as hasten.models.gguf leaves a dequantised GGUF in the cache."""
    save_checkpoint(directory)
    record = {"source": f"/somewhere/site-packages/pkg/{gguf_name}", "bytes": gguf_bytes}
    (directory / real.GGUF_RECORD).write_text(json.dumps(record))
    return directory


def test_a_packaged_models_cached_copy_finds_the_modules_shipped_in_the_zoo(tmp_path, monkeypatch):
    smollm2 = real.MODELS["smollm2-135m"]
    checkpoint = dequantised_copy(tmp_path / "cache" / "smollm2-abc", smollm2.gguf_name, smollm2.gguf_bytes)
    target = AutoModelForCausalLM.from_pretrained(checkpoint)
    shipped_root = tmp_path / "zoo-weights"
    torch.manual_seed(1)
    heads = MedusaHeads.for_target(target, num_heads=2)
    heads.save(shipped_root / "smollm2-135m" / "medusa")
    monkeypatch.setattr(real, "SHIPPED_DRAFTERS", shipped_root)

    assert real.packaged_name(checkpoint) == "smollm2-135m"
    assert real.shipped_drafter(checkpoint, "medusa") == shipped_root / "smollm2-135m" / "medusa"
    assert real.shipped_drafter(checkpoint, "eagle") is None  # none shipped in this layout
    found = Medusa().find_module(target)
    assert found.levels == 2
    for name, tensor in heads.state_dict().items():
        assert torch.equal(found.state_dict()[name], tensor.half().float())
    # and the drafter runs on it, lossless
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    plain = hasten.generate(target, prompt, max_new_tokens=12).sequences
    assert torch.equal(hasten.generate(target, prompt, drafter=Medusa(), max_new_tokens=12).sequences, plain)


@pytest.mark.parametrize("name, size", [("SmolLM2-135M-Instruct.Q4_0.gguf", 98_362_432),
                                        ("SmolLM2-135M-Instruct.Q4_1.gguf", 1234)])
def test_another_gguf_gets_no_shipped_module(tmp_path, monkeypatch, name, size):
    checkpoint = dequantised_copy(tmp_path / "other", name, size)
    monkeypatch.setattr(real, "SHIPPED_DRAFTERS", tmp_path / "zoo-weights")
    MedusaHeads.for_target(tiny_model("llama")).save(tmp_path / "zoo-weights" / "smollm2-135m" / "medusa")
    assert real.packaged_name(checkpoint) is None
    target = AutoModelForCausalLM.from_pretrained(checkpoint)
    with pytest.warns(HastenWarning, match="no medusa weights"):
        Medusa().find_module(target)


def test_a_plain_checkpoint_is_no_packaged_model(tmp_path):
    assert real.packaged_name(save_checkpoint(tmp_path)) is None


# ---- the modules shipped for SmolLM2-135M ------------------------------------------------------------
SHIPPED = Path(real.SHIPPED_DRAFTERS) / "smollm2-135m"
SMOLLM2_SIZES = {"hidden_size": 576, "vocab_size": 49152}


@pytest.mark.parametrize("drafter", [Medusa, Eagle])
def test_modules_shipped_for_smollm2_are_small_float16_and_fit_it(drafter):
    directory = SHIPPED / drafter.name
    config = json.loads((directory / f"{drafter.name}.json").read_text())
    assert {k: config[k] for k in SMOLLM2_SIZES} == SMOLLM2_SIZES
    assert (directory / "weights.q8.safetensors.xz").stat().st_size <= 10.5 * 2**20  # shipped packed
    copy = unpacked(directory)  # what the drafter loads: float16, in the cache
    assert all(t.dtype == torch.float16 for t in load_file(copy / "weights.safetensors").values())
    module = drafter.Module.load(copy)
    if drafter is Medusa:  # its tree is chosen from the heads' held-out rank accuracies, recorded at training
        assert len(module.config.accuracy) == module.levels
    assert (directory / "training.json").is_file()  # how it was trained: the command's settings and times
