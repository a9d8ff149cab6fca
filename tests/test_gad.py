"""GAD in its seq2seq home: on an encoder-decoder the drafter cross-attends to the target's
encoder states of the whole source, is trained with them (``hasten train gad`` on an
encoder-decoder: corrupted gec sentences and the target's own corrections), and greedy output
stays token-identical to plain decoding on T5- and BART-style targets, trained or not; the
decoder-only drafter keeps working as before."""
import json
import math

import pytest
import torch

import hasten
from hasten.cli import main
from hasten.core.sampling import Sampling
from hasten.drafters.gad import GAD, GADModel, GADTraining, GADTrainOptions
from hasten.drafters.gad_seq2seq import CorrectionPairs, until_eos
from hasten.zoo import gec
from test_verify_law import bound
from helpers import (distill_tiny, hf_greedy, opinionated, repetitive_prompt, save_checkpoint, tiny_model,
                     train_briefly)

NEW = 20
SEQ2SEQ = ("t5", "bart")


class WatchedGAD(GAD):
    """Keeps each generation's state (its keys and values of the encoder states it read)."""

    def start(self, ctx):
        self.state = super().start(ctx)
        self.source = ctx.source
        return self.state


def corrections(model, count: int = 6, seed: int = 0) -> CorrectionPairs:
    """Random sources and the target's own greedy outputs: two held-out rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 14, (count,), generator=g).tolist()
    sources = [torch.randint(3, 90, (n,), generator=g).tolist() for n in lengths]
    outputs = [until_eos(hf_greedy(model, torch.tensor([s]), 12)[0].tolist(), model.config.eos_token_id)
               for s in sources]
    return CorrectionPairs(sources, outputs, held_out=2)


@pytest.mark.parametrize("arch", SEQ2SEQ)
def test_the_drafter_reads_the_whole_source_and_greedy_output_is_plain(arch, tmp_path):
    model = tiny_model(arch)
    prompt = repetitive_prompt(20, seed=1)
    module = opinionated(GADModel.for_target(model, block=4), seed=3)
    assert module.config.encoder_size == model.config.d_model and len(module.cross) == module.config.layers
    module.save(tmp_path)
    reference = hf_greedy(model, prompt, NEW)
    encodings = []  # the encoder runs once a generation: the drafter reads the target's output
    watch = model.get_encoder().register_forward_hook(lambda *args: encodings.append(1))
    for settings in (dict(), dict(top_k=2, tree_size=6)):
        drafter = WatchedGAD(weights=str(tmp_path), **settings)
        encodings.clear()
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, draft_size="fixed")
        assert len(encodings) == 1
        assert out.sequences.tolist() == reference.tolist()
        assert out.stats.drafted_tokens > 0
        states = model.get_encoder()(input_ids=prompt).last_hidden_state  # [1, s, d]: every source token's
        with torch.no_grad():
            expected = drafter.module.read_source(states)
        assert len(drafter.state) == module.config.layers
        for (keys, values), (k, v) in zip(drafter.state, expected):
            assert keys.shape[2] == prompt.shape[1] and torch.allclose(keys, k) and torch.allclose(values, v)
    watch.remove()


def test_slots_depend_on_a_far_source_token():
    """A slot's guess changes when a source token far from the output position changes: the
    drafter reads the whole source, not a window around the position."""
    model = tiny_model("t5")
    module = opinionated(GADModel.for_target(model, block=3), seed=4).eval()
    embed = model.get_input_embeddings()
    window, present = embed(torch.tensor([[0, 5, 7]])), torch.ones(1, 3, dtype=torch.bool)
    positions = torch.arange(6)[None]  # the root at output position 2, slots at 3 .. 5
    feature = torch.zeros(1, model.config.d_model)
    source = torch.randint(3, 90, (1, 40))
    far = source.clone()
    far[0, -1] = (far[0, -1] + 1) % 90  # 35 positions past the slots
    with torch.no_grad():
        states = [model.get_encoder()(input_ids=s).last_hidden_state for s in (source, far)]
        slots = [module(window, present, feature, positions, s) for s in states]
    assert not torch.allclose(slots[0], slots[1])


@pytest.mark.parametrize("arch", SEQ2SEQ)
def test_trained_with_the_source_and_still_exact(arch, tmp_path):
    model = tiny_model(arch)
    data = corrections(model)
    options = GADTrainOptions(block=3, window=4, anchors=4)
    training = GADTraining(model, options)
    module = opinionated(training.build(), seed=5)
    batch = data.batch(torch.arange(4), model)
    assert batch.source.shape[:2] == batch.source_present.shape and not batch.label_mask[:, 0].any()
    torch.manual_seed(0)
    loss, metrics = training.loss(module, batch)
    changed = type(batch)(**{**batch.__dict__, "source": batch.source.flip(1)})  # the same sources, reversed
    torch.manual_seed(0)  # the same roots
    assert not torch.isclose(loss, training.loss(module, changed)[0])  # the loss reads the source
    assert math.isfinite(float(loss)) and "head1_rank0" in metrics

    out = train_briefly(training, data, tmp_path, steps=3)
    assert GADModel.load(out).config.encoder_size == model.config.d_model
    for row in (0, len(data) - 1):  # a training row and a held-out one
        prompt = torch.tensor([data.sources[row]])
        reference = hf_greedy(model, prompt, NEW)
        generated = hasten.generate(model, prompt, drafter=GAD(weights=str(out)), max_new_tokens=NEW,
                                    draft_size="fixed")
        assert generated.sequences.tolist() == reference.tolist()


def test_the_decoder_only_drafter_is_unchanged(tmp_path):
    """A causal target: no encoder states, positions from the window's start, trained on
    self-distilled text as before; greedy output is plain."""
    model = tiny_model("llama")
    training = GADTraining(model, GADTrainOptions(block=3, window=4, anchors=4))
    assert training.build().config.encoder_size == 0 and not hasattr(training.build(), "cross")
    out = train_briefly(training, distill_tiny(model, tmp_path / "work"), tmp_path / "gad", steps=3)
    prompt = repetitive_prompt(20, seed=1)
    drafter = WatchedGAD(weights=str(out))
    generated = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, draft_size="fixed")
    assert generated.sequences.tolist() == hf_greedy(model, prompt, NEW).tolist()
    assert drafter.state is None and drafter.source is None


def fake_sentences() -> list[str]:
    """Forty training sentences and every held-out one of a few hundred made-up ones."""
    made = [f"The value number {i} is returned when the key is found." for i in range(400)]
    held = [s for s in made if gec.is_heldout(s)]
    return [s for s in made if not gec.is_heldout(s)][:40] + held


def test_hasten_train_gad_on_the_gec_model(tmp_path, monkeypatch):
    monkeypatch.setattr(gec, "sentences", fake_sentences)
    out = tmp_path / "gad"
    code = main(["train", "gad", "--model", "zoo:gec-tiny", "--out", str(out), "--samples", "12", "--gen-tokens",
                 "40", "--steps", "2", "--batch-size", "4", "--block", "3", "--threads", "1"])
    assert code == 0
    config = json.loads((out / "gad.json").read_text())
    report = json.loads((out / "training.json").read_text())
    assert config["encoder_size"] == 128 and config["block"] == 3
    distilled = report["distill"]
    assert distilled["source"] == "hasten.zoo.gec" and distilled["held_out"] > 0
    assert distilled["sequences"] == 12 + distilled["held_out"]
    assert "head1_rank0" in report["eval"]


def test_hasten_train_refuses_text_for_an_encoder_decoder_and_asks_a_causal_lm_for_text(tmp_path, capsys):
    assert main(["train", "gad", "--model", "zoo:gec-tiny", "--out", str(tmp_path / "a"), "--pydoc-topics"]) != 0
    assert "own task" in capsys.readouterr().err
    causal = save_checkpoint(tmp_path / "llama")
    assert main(["train", "gad", "--model", causal, "--out", str(tmp_path / "b")]) != 0
    assert "--data, --zoo-corpus or --pydoc-topics" in capsys.readouterr().err


# ---- sampling: the target's law on an encoder-decoder ------------------------------------------
LAW_SAMPLING = Sampling(1.0)  # 64 outcomes of the first 2 tokens
LAW_SAMPLES = 1500


def peaky_t5():
    """A T5 of 8 tokens whose first token has probabilities from 0.5 % to 68 %."""
    return tiny_model("t5", seed=2, vocab_size=8, bos_token_id=0, eos_token_id=None, pad_token_id=0)


def seq2seq_law(model, source: torch.Tensor, length: int) -> dict[tuple[int, ...], float]:
    """The target's law of its first ``length`` tokens after ``source``, every outcome listed."""
    law = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, weight in law.items():
            decoder = torch.tensor([[model.config.decoder_start_token_id, *prefix]])
            with torch.no_grad():
                probs = LAW_SAMPLING.probs(model(input_ids=source, decoder_input_ids=decoder).logits[0, -1])
            grown.update({prefix + (t,): weight * float(probs[t]) for t in range(len(probs)) if probs[t] > 0})
        law = grown
    return law


@pytest.mark.heavy  # about 30 s on the 2-core VM
def test_sampled_output_follows_the_target_with_a_source_reading_drafter(tmp_path):
    """Drafts 2 deep, accepted and rejected: the first 2 tokens keep the plain model's law."""
    model = peaky_t5()
    source = torch.tensor([[3, 5, 1, 6, 2, 7, 4]])
    opinionated(GADModel.for_target(model, block=3), seed=10).save(tmp_path)  # drafts accepted about half the time
    law = seq2seq_law(model, source, 2)
    drafter = GAD(weights=str(tmp_path))
    counts = dict.fromkeys(law, 0)
    g = torch.Generator().manual_seed(7)
    accepted = drafted = 0
    for _ in range(LAW_SAMPLES):
        out = hasten.generate(model, source, drafter=drafter, max_new_tokens=3, temperature=1.0, generator=g,
                              draft_size="fixed")
        counts[tuple(out.sequences[0, 1:3].tolist())] += 1
        accepted, drafted = accepted + out.stats.accepted_tokens, drafted + out.stats.drafted_tokens
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    tv = 0.5 * sum(abs(counts[k] / LAW_SAMPLES - p) for k, p in law.items())
    assert tv < bound(law, LAW_SAMPLES), f"TV {tv:.3f}"
