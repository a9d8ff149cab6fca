"""Self-distillation, the generic trainer (checkpoints, resume) and `hasten train`."""
import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import hasten
import hasten.drafters.medusa  # noqa: F401  registers medusa until hasten.drafters imports it
import hasten.training.distill as distill_module
from hasten.cli import main
from hasten.drafters.base import Drafter
from hasten.drafters.medusa import Medusa, MedusaTraining, MedusaTrainOptions
from hasten.training.cli import trainable_drafters
from hasten.training.distill import DistillSettings, distill, read_documents
from hasten.training.trainer import CHECKPOINT, Trainable, TrainSettings, option, train
from helpers import TRAIN_TEXT as TEXT, save_checkpoint, tiny_model, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
SMALL = DistillSettings(samples=6, prompt_tokens=8, gen_tokens=12)
MODEL = tiny_model("llama")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return distill(MODEL, TOKENIZER, TEXT, SMALL, tmp_path_factory.mktemp("distill"), source="test", progress=False)


# ---- distillation ----------------------------------------------------------------------------
def test_distilled_labels_are_the_target_continuation(data):
    assert len(data) == SMALL.samples
    for row in range(len(data)):
        length, prompt = int(data.lengths[row]), int(data.prompt_lengths[row])
        sequence = data.ids[row, :length][None]
        expected = hasten.generate(MODEL, sequence[:, :prompt], max_new_tokens=SMALL.gen_tokens).sequences
        assert torch.equal(sequence, expected)
        hidden = MODEL(sequence, output_hidden_states=True).hidden_states[-1][0]  # [L, H]
        assert torch.allclose(data.hidden[row, :length].float(), hidden, atol=1e-2)
    batch = data.batch(torch.tensor([0, 1]), MODEL)
    position = torch.arange(batch.ids.shape[1])
    for i in range(2):
        expected_mask = (position >= data.prompt_lengths[i]) & (position < data.lengths[i])
        assert torch.equal(batch.label_mask[i], expected_mask)


def test_hidden_states_recomputed_when_not_stored(data, tmp_path):
    lean = distill(MODEL, TOKENIZER, TEXT, DistillSettings(**{**SMALL.__dict__, "store_hidden": False}), tmp_path,
                   source="test", progress=False)
    assert lean.hidden is None and torch.equal(lean.ids, data.ids)
    for row in range(len(data)):  # (padding is zero in the cache, anything when recomputed)
        rows, length = torch.tensor([row]), int(data.lengths[row])
        assert torch.allclose(lean.batch(rows, MODEL).hidden[0, :length], data.batch(rows, MODEL).hidden[0, :length], atol=1e-2)


def test_interrupted_distillation_resumes(data, tmp_path, monkeypatch):
    calls = []

    def generate_three(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return hasten.generate(*args, **kwargs)

    monkeypatch.setattr(distill_module, "SAVE_EVERY_S", 0.0)
    monkeypatch.setattr(distill_module, "generate", generate_three)
    with pytest.raises(KeyboardInterrupt):
        distill(MODEL, TOKENIZER, TEXT, SMALL, tmp_path, source="test", progress=False)
    assert load_file(tmp_path / distill_module.CACHE)["ids"].shape[0] == 3
    monkeypatch.setattr(distill_module, "generate", hasten.generate)
    resumed = distill(MODEL, TOKENIZER, TEXT, SMALL, tmp_path, source="test", resume=True, progress=False)
    assert torch.equal(resumed.ids, data.ids) and torch.equal(resumed.hidden, data.hidden)
    # complete now: resuming again generates nothing, and a cache of other data is not reused
    def refuse(*args, **kwargs):
        raise RuntimeError("generated")

    monkeypatch.setattr(distill_module, "generate", refuse)
    assert torch.equal(distill(MODEL, TOKENIZER, TEXT, SMALL, tmp_path, source="test", resume=True, progress=False).ids, data.ids)
    with pytest.raises(RuntimeError, match="generated"):
        distill(MODEL, TOKENIZER, TEXT, SMALL, tmp_path, source="other text", resume=True, progress=False)


def test_read_documents(tmp_path):
    (tmp_path / "a.jsonl").write_text('"one"\n\n{"text": "two", "id": 3}\n')
    assert read_documents(tmp_path / "a.jsonl") == ["one", "two"]
    (tmp_path / "b.txt").write_text("all\nof it\n")
    assert read_documents(tmp_path / "b.txt") == ["all\nof it\n"]
    (tmp_path / "c.jsonl").write_text('"fine"\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="c.jsonl:2"):
        read_documents(tmp_path / "c.jsonl")
    with pytest.raises(ValueError, match=".txt or .jsonl"):
        read_documents(tmp_path / "d.csv")


# ---- the trainer -----------------------------------------------------------------------------
def test_lr_schedule():
    schedule = TrainSettings(steps=100, lr=1.0, warmup_steps=10).lr_schedule
    assert [schedule.scale(i, None) for i in range(10)] == [schedule.scale(i, 100) for i in range(10)]  # warmup ignores the plan
    assert schedule.scale(9, 100) == schedule.scale(10, 100) == 1.0
    assert schedule.scale(100, 100) == pytest.approx(0.1)
    assert schedule.scale(10, 100, time_share=0.9) == 1.0  # paced by the planned steps; time only stops the run


class Interrupted(MedusaTraining):
    """Stops the run like Ctrl-C would, in the middle of step `at`."""

    at = 5

    def loss(self, module, batch):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return super().loss(module, batch)


def test_resume_is_bit_for_bit(data, tmp_path):
    settings = TrainSettings(steps=7, lr=1e-2, warmup_steps=2, batch_size=3, checkpoint_every=2)
    options = MedusaTrainOptions(num_heads=2)
    straight = train(MedusaTraining(MODEL, options), data, settings, tmp_path / "a", progress=False)
    with pytest.raises(KeyboardInterrupt):
        train(Interrupted(MODEL, options), data, settings, tmp_path / "b", progress=False)
    assert load_file(tmp_path / "b" / CHECKPOINT)["sampler"] is not None
    resumed = train(MedusaTraining(MODEL, options), data, settings, tmp_path / "b", resume=True, progress=False)
    assert resumed.report["steps"] == straight.report["steps"] == 7
    final_a, final_b = load_file(tmp_path / "a" / CHECKPOINT), load_file(tmp_path / "b" / CHECKPOINT)
    assert final_a.keys() == final_b.keys() and any(k.startswith("optimizer.") for k in final_a)
    for key in final_a:  # weights, AdamW moments and the sampler state
        assert torch.equal(final_a[key], final_b[key]), key
    with pytest.raises(ValueError, match="other settings"):
        train(MedusaTraining(MODEL, options), data, TrainSettings(steps=7, lr=1.0), tmp_path / "b", resume=True, progress=False)


def test_training_lowers_the_loss(data, tmp_path):
    options = MedusaTrainOptions(num_heads=2)
    before = train(MedusaTraining(MODEL, options), data, TrainSettings(steps=1, lr=1e-9, warmup_steps=1), tmp_path / "a", progress=False)
    after = train(MedusaTraining(MODEL, options), data, TrainSettings(steps=40, lr=1e-2, warmup_steps=5), tmp_path / "b", progress=False)
    assert after.report["train"]["loss"] < before.report["train"]["loss"]


def test_a_time_budget_plans_the_steps(data, tmp_path):
    report = train(MedusaTraining(MODEL, MedusaTrainOptions(num_heads=1)), data,
                   TrainSettings(minutes=0.01, warmup_steps=5), tmp_path, progress=False).report
    assert report["planned_steps"] >= 5 and report["steps"] <= report["planned_steps"]


# ---- hasten train ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("train-cli")
    (root / "code.txt").write_text("".join(TEXT))
    return save_checkpoint(root / "model"), root / "code.txt"


def train_args(model, data, out, *extra):
    return ["train", "medusa", "--model", str(model), "--data", str(data), "--out", str(out), "--samples", "6",
            "--prompt-tokens", "8", "--gen-tokens", "12", "--steps", "4", "--num-heads", "2", "--threads", "1", *extra]


def test_train_command_end_to_end(checkpoint, tmp_path):
    model_dir, text = checkpoint
    out = tmp_path / "heads"
    assert main(train_args(model_dir, text, out)) == 0
    assert {"weights.safetensors", "medusa.json", "training.json"} <= {p.name for p in out.iterdir()}
    config = json.loads((out / "medusa.json").read_text())
    assert config["num_heads"] == 2 and config["target"] == str(model_dir) and config["share_lm_head"]
    assert all(key.startswith("blocks.") for key in load_file(out / "weights.safetensors"))  # the LM head is not copied
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 4 and report["distill"]["sequences"] == 6
    engine = hasten.load(model_dir, "medusa", weights=str(out))
    plain = hasten.load(model_dir, "autoregressive")
    prompt = "def add(a, b):\n    return a + b\n\ndef add("
    assert engine.generate(prompt, max_new_tokens=20).token_ids == plain.generate(prompt, max_new_tokens=20).token_ids
    weights = load_file(out / "weights.safetensors")
    assert main(train_args(model_dir, text, out, "--resume")) == 0  # everything reused, nothing changes
    assert all(torch.equal(t, load_file(out / "weights.safetensors")[k]) for k, t in weights.items())


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0 and "medusa" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "medusa", "--help"])
    text = capsys.readouterr().out
    import dataclasses

    for settings_cls in (MedusaTrainOptions, DistillSettings, TrainSettings):
        for field in dataclasses.fields(settings_cls):
            assert "--" + field.name.replace("_", "-") in text
    for flag in ("--model", "--out", "--data", "--zoo-corpus", "--work-dir", "--resume", "--threads", "--device"):
        assert flag in text


@pytest.mark.parametrize("change, match", [
    ({"--model": "/no/such/model"}, "could not be loaded"),
    ({"--steps": "0"}, "steps must be >= 1"),
    ({"--num-heads": "0"}, "num_heads must be >= 1"),
    ({"--data": "/no/such/file.txt"}, "No such file"),
    ({"--data": "notes.csv"}, ".txt or .jsonl"),
])
def test_bad_input_is_one_line_exit_2(checkpoint, tmp_path, capsys, change, match):
    args = train_args(*checkpoint, tmp_path / "out")
    for flag, value in change.items():
        args[args.index(flag) + 1] = value
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and "\n" not in err


def test_unknown_drafter_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "nope", "--model", "x"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "invalid choice: 'nope'" in err and "\n" not in err


# ---- the protocol: a new drafter plugs in by its Training class alone -------------------------------
@dataclass(frozen=True)
class ToyOptions:
    shift: int = option(2, "predict the token this far ahead")


class ToyTraining(Trainable):
    Options = ToyOptions

    def build(self):
        return torch.nn.Linear(self.target.config.hidden_size, self.target.config.vocab_size)

    def loss(self, module, batch):
        s = self.options.shift
        keep = batch.label_mask[:, s:]
        return F.cross_entropy(module(batch.hidden[:, :-s][keep]), batch.ids[:, s:][keep]), {}

    def save(self, module, out_dir, report):
        save_file(module.state_dict(), out_dir / "toy.safetensors")


class Toy(Drafter):
    name = "toy"
    Training = ToyTraining


def test_a_new_trainable_drafter_plugs_in(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(hasten.drafters.REGISTRY, "toy", Toy)
    found = trainable_drafters()
    assert found["toy"] is ToyTraining and found["medusa"] is MedusaTraining
    model_dir, text = checkpoint
    args = train_args(model_dir, text, tmp_path)
    args[1] = "toy"
    args[args.index("--num-heads"): args.index("--num-heads") + 2] = ["--shift", "3"]
    assert main(args) == 0
    assert (tmp_path / "toy.safetensors").is_file()
    assert json.loads((tmp_path / "training.json").read_text())["options"] == {"shift": 3}
    assert Medusa.Training is MedusaTraining
