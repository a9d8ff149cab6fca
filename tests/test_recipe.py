"""hasten train recipe: conversation rows, the feature store (resume), the held-out split, the
teacher-forced acceptance probe against the decode loop, and the recipe end to end, all on a
tiny chat model and the data its own `hasten train data` run wrote."""
from __future__ import annotations

import json

import pytest
import torch

import hasten
import hasten.training.conversations as conversations
from hasten.drafters import REGISTRY
from hasten.drafters.base import Draft, Drafter
from hasten.training.acceptance import ProbeSettings, accepted_length, teacher_forced
from hasten.training.acceptance_log import AcceptanceLog
from hasten.training.conversations import conversation_rows, is_held_out
from hasten.training.feature_data import FeatureData
from hasten.training.features import FeatureSettings, FeatureStore, extract_features
from hasten.training.recipe import RECIPE_METHODS, RecipeSettings, run_recipe, stored_layers
from hasten.training.selfgen import SelfGenSettings, generate_data, read_records, training_pairs
from hasten.training.trainer import TrainSettings
from helpers import chat_model

DATA = dict(seed=3, batch=4, chunk=4, user_tokens=40, answer_tokens=24, dtype="float32", followup_share=0.5)
FEATURES = FeatureSettings(feature_dtype="float16", extract_batch=2, commit_minutes=60)
HELD_OUT_EVERY = 2  # the tiny data has a dozen conversations: hold out half, so both sides have some


@pytest.fixture(scope="module")
def chat():
    """A tiny random chat model, its tokenizer and an engine: its LM head scaled up and its end-of-turn
    token favoured, so that some sampled user turns end and its greedy answers run on."""
    from hasten.api import load

    model, tokenizer = chat_model(eos_bias=2.0, scale=15, num_hidden_layers=8)
    return model, tokenizer, load(model, "autoregressive", tokenizer=tokenizer, threads=1)


@pytest.fixture(scope="module")
def data_dir(chat, tmp_path_factory):
    out = tmp_path_factory.mktemp("selfgen")
    generate_data(chat[2], SelfGenSettings(samples=24, **DATA), out, model_name="tiny", progress_bar=False)
    return out


@pytest.fixture(autouse=True)
def half_held_out(monkeypatch):
    monkeypatch.setattr(conversations, "HELD_OUT_EVERY", HELD_OUT_EVERY)


@pytest.fixture(scope="module")
def store_dir(chat, data_dir, tmp_path_factory):
    model, tokenizer, _ = chat
    out = tmp_path_factory.mktemp("features")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversations, "HELD_OUT_EVERY", HELD_OUT_EVERY)
        extract_features(model, tokenizer, data_dir, out, stored_layers(model), FEATURES, model_name="tiny",
                         progress=False)
    return out


# ---- rows and features ---------------------------------------------------------------------------
def test_rows_are_each_answer_after_its_prompt_and_only_answers_are_labels(chat, data_dir, store_dir):
    model, tokenizer, _ = chat
    records = list(read_records(data_dir))
    assert len(records) >= 6
    expected = [(r["index"], p, a) for r in records for p, a in training_pairs(r, tokenizer)]
    rows = list(conversation_rows(records, tokenizer, max_tokens=1024))
    assert [(row.record, list(row.ids), row.prompt_length) for row in rows] == \
        [(i, p + a, len(p)) for i, p, a in expected]
    store = FeatureStore(store_dir)
    data = FeatureData(store, (8,), last_layer=8)
    assert len(data) == len(rows)
    batch = data.batch(torch.arange(len(data)), model)
    for b, (_, prompt, answer) in enumerate(expected):
        n = len(prompt) + len(answer)
        assert batch.ids[b, :n].tolist() == prompt + answer and not batch.ids[b, n:].any()
        assert batch.label_mask[b].nonzero().flatten().tolist() == list(range(len(prompt), n))


def test_features_are_the_targets_own_hidden_states_and_greedy_tokens(chat, store_dir):
    model, _, _ = chat
    store = FeatureStore(store_dir)
    assert store.layers == stored_layers(model) == (2, 4, 5, 8)  # EAGLE-3's 2, N // 2, N - 3 and the last
    for row in range(3):
        ids = store.read(row, "ids").long()[None]
        out = model(ids, output_hidden_states=True)
        assert torch.equal(store.read(row, "greedy").long(), out.logits[0].argmax(-1))
        for k in store.layers:
            torch.testing.assert_close(store.read(row, f"layer.{k}").float(), out.hidden_states[k][0],
                                       atol=2e-3, rtol=2e-3)


def test_an_interrupted_extraction_resumes_to_the_same_features(chat, data_dir, store_dir, tmp_path):
    model, tokenizer, _ = chat
    layers = stored_layers(model)
    first = extract_features(model, tokenizer, data_dir, tmp_path, layers, FEATURES, model_name="tiny",
                             progress=False, stop_after_rows=3)
    whole = FeatureStore(store_dir)
    assert 3 <= first.rows < len(whole)
    (tmp_path / "shard-00099.safetensors").write_bytes(b"torn")  # written by a run killed before its manifest
    extract_features(model, tokenizer, data_dir, tmp_path, layers, FEATURES, model_name="tiny", progress=False)
    assert not (tmp_path / "shard-00099.safetensors").exists()
    resumed = FeatureStore(tmp_path)
    assert len(resumed) == len(whole) and len(resumed.manifest.shards) == 2
    assert resumed.manifest.records_done == whole.manifest.records_done
    for row in range(len(whole)):
        for field in ("ids", "greedy", *(f"layer.{k}" for k in layers)):
            assert torch.equal(resumed.read(row, field), whole.read(row, field)), (row, field)
    # nothing new: a run commits nothing more
    again = extract_features(model, tokenizer, data_dir, tmp_path, layers, FEATURES, model_name="tiny", progress=False)
    assert again.rows == len(whole)
    with pytest.raises(ValueError, match="dtype"):
        extract_features(model, tokenizer, data_dir, tmp_path, layers, FeatureSettings(feature_dtype="bfloat16"),
                         model_name="tiny", progress=False)


def test_held_out_conversations_are_never_training_rows(data_dir, store_dir):
    store = FeatureStore(store_dir)
    train_rows, held_rows = FeatureData(store, (), last_layer=8).split()
    assert len(train_rows) and len(held_rows) and len(train_rows) + len(held_rows) == len(store)
    trained = set(store.records[train_rows].tolist())
    held = set(store.records[held_rows].tolist())
    assert not trained & held
    by_index = {r["index"]: r for r in read_records(data_dir)}
    assert all(is_held_out(by_index[i]) for i in held) and not any(is_held_out(by_index[i]) for i in trained)


def test_the_held_out_hash_is_fixed():
    record = {"seed": 1748960230, "index": 12}
    assert is_held_out(record) == is_held_out(dict(record)) and conversations.HELD_OUT_EVERY == HELD_OUT_EVERY
    shares = sum(is_held_out({"seed": s, "index": s}) for s in range(2000)) / 2000
    assert 0.4 < shares < 0.6


# ---- the acceptance probe ---------------------------------------------------------------------------
class PlantedErrors(Drafter):
    """Proposes the reference continuation with its token at a depth that depends on the root
    wrong (none at some roots); records the loop's verdict at every root."""

    name = "planted"

    def __init__(self, reference: list[int], depth: int):
        self.reference, self.depth, self.verdicts, self.last = reference, depth, [], None

    def wrong_at(self, root: int) -> int:
        return (3 * root) % (self.depth + 1)

    def propose(self, ctx):
        root = len(ctx.tokens) - 1
        right = self.reference[root + 1 : root + 1 + min(self.depth, ctx.max_depth)]
        self.last = (root, ctx.max_depth)
        wrong = self.wrong_at(root)
        return Draft.chain([(t + 1) % ctx.target.vocab_size if i == wrong else t for i, t in enumerate(right)])

    def observe(self, ctx, result):
        self.verdicts.append((*self.last, result.accepted))


def test_acceptance_is_what_the_decode_loop_accepts_for_a_scripted_drafter(chat):
    model, _, _ = chat
    prompt, depth = torch.tensor([[5, 17, 33, 9, 41, 12, 7]]), 4
    reference = hasten.generate(model, prompt, max_new_tokens=48, eos_token_id=[]).sequences[0].tolist()
    looped = PlantedErrors(reference, depth)
    out = hasten.generate(model, prompt, drafter=looped, max_new_tokens=48, draft_size="fixed", eos_token_id=[])
    assert out.sequences[0].tolist() == reference
    probed = {r.root: r for r in teacher_forced(PlantedErrors(reference, depth), model, reference,
                                                prompt.shape[1] - 1, depth)}
    assert len(probed) == len(reference) - prompt.shape[1] - depth + 2  # roots P - 1 .. n - depth
    compared = 0
    for root, max_depth, accepted in looped.verdicts:
        if max_depth >= depth:
            assert probed[root].chain == probed[root].tree == accepted == min(looped.wrong_at(root), depth)
            compared += 1
    assert compared >= 8
    assert all(r.chain == min(looped.wrong_at(r.root), depth) for r in probed.values())


def test_accepted_length_follows_the_matching_branch():
    from hasten.core.tree import TokenTree

    draft = Draft((7, 8, 9, 4, 5), TokenTree((-1, -1, 0, 1, 3)))  # 7 -> 9; 8 -> 4 -> 5
    assert accepted_length(draft, [8, 4, 5]) == 3
    assert accepted_length(draft, [7, 9, 1]) == 2
    assert accepted_length(draft, [1, 2]) == 0
    assert accepted_length(draft.main_chain(3), [8, 4, 5]) == 0  # the main chain is 7 -> 9


# ---- the recipe ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recipe(chat, data_dir, tmp_path_factory):
    model, tokenizer, _ = chat
    root = tmp_path_factory.mktemp("recipe")
    settings = dict(model_name="tiny", data_dir=data_dir, work_dir=root / "work", out_dir=root / "out",
                    recipe=RecipeSettings(), feature_settings=FEATURES,
                    train_settings=TrainSettings(steps=4, batch_size=2, warmup_steps=1, checkpoint_every=2),
                    probe_settings=ProbeSettings(probe_depth=3, probe_positions=40), progress=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversations, "HELD_OUT_EVERY", HELD_OUT_EVERY)
        reports = run_recipe(model, tokenizer, **settings)
    return root, reports, settings


def test_the_recipe_trains_every_method_and_logs_held_out_acceptance(recipe):
    root, reports, _ = recipe
    assert list(reports) == list(RECIPE_METHODS)
    log = AcceptanceLog(root / "work" / "acceptance.json")
    assert log.methods() == sorted(RECIPE_METHODS) and (root / "work" / "acceptance.png").stat().st_size > 0
    for method, report in reports.items():
        entries = log.of(method)
        assert [e["step"] for e in entries] == [2, 4]
        assert entries[0]["tokens"] < entries[1]["tokens"] == report["tokens"] > 0
        for e in entries:
            assert len(e["acceptance"]) == 3 and e["positions"] > 0 and 1 <= e["tau"] <= 4
            assert e["acceptance"] == sorted(e["acceptance"], reverse=True)
        assert report["data"]["held_out_rows"] > 0 and report["acceptance"]["step"] == 4
        saved = json.loads((root / "out" / method / "training.json").read_text())
        assert saved["steps"] == 4 and saved["drafter"] == method


def test_recipe_weights_load_and_decode_exactly(chat, recipe):
    model, _, _ = chat
    root, _, _ = recipe
    prompt = torch.tensor([[5, 17, 33, 9, 41, 12, 7]])
    reference = hasten.generate(model, prompt, max_new_tokens=24, eos_token_id=[]).sequences
    for method in RECIPE_METHODS:
        drafter = REGISTRY[method](weights=str(root / "out" / method), require_weights=True)
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=24, draft_size="fixed", eos_token_id=[])
        assert torch.equal(out.sequences, reference), method


@pytest.mark.parametrize("method", RECIPE_METHODS)
def test_probe_matches_the_loop_for_every_trained_drafter(chat, recipe, method):
    """The decode loop's accepted length at each step equals the probe's at the same root."""
    model, _, _ = chat
    root, _, _ = recipe
    prompt, depth = torch.tensor([[5, 17, 33, 9, 41, 12, 7]]), 8
    reference = hasten.generate(model, prompt, max_new_tokens=40, eos_token_id=[]).sequences[0].tolist()
    weights = str(root / "out" / method)
    looped, verdicts = REGISTRY[method](weights=weights), []
    propose, last = looped.propose_rows, {}

    def recording_propose(ctxs):
        (ctx,) = ctxs  # one row
        last["step"] = (len(ctx.tokens) - 1, ctx.max_depth)
        return propose(ctxs)

    observe = looped.observe

    def recording_observe(ctx, result):
        verdicts.append((*last["step"], result.accepted))
        observe(ctx, result)

    looped.propose_rows, looped.observe = recording_propose, recording_observe
    hasten.generate(model, prompt, drafter=looped, max_new_tokens=40, draft_size="fixed", eos_token_id=[])
    probed = {r.root: r for r in teacher_forced(REGISTRY[method](weights=weights), model, reference,
                                                prompt.shape[1] - 1, depth)}
    # (the loop's first step is skipped: hidden transfer has no guesses there yet, where the probe's
    # warm-up root gave it some; the planner drafts no deeper than the drafter can, so a step that
    # reached the drafter's own depth saw everything the probe did)
    reach = min(depth, looped.deepest() or depth)
    compared = [(root_, accepted, probed[root_].tree) for root_, max_depth, accepted in verdicts[1:]
                if max_depth >= reach and root_ in probed]
    assert len(compared) >= 3
    assert [a for _, a, _ in compared] == [t for _, _, t in compared]


def test_eagle3_probe_reads_the_features_of_its_own_forward(chat, recipe, monkeypatch):
    """EAGLE-3's taps see the probe's one forward per row: no committed row is recomputed."""
    from hasten.drafters.eagle3 import LayerTaps, MissingFeatures

    model, _, _ = chat
    root, _, _ = recipe
    misses, found = [], LayerTaps.features

    def counted(self, last, kept=()):
        try:
            return found(self, last, kept)
        except MissingFeatures:
            misses.append(len(last))
            raise

    monkeypatch.setattr(LayerTaps, "features", counted)
    ids = hasten.generate(model, torch.tensor([[5, 17, 33, 9]]), max_new_tokens=20, eos_token_id=[]).sequences[0]
    results = teacher_forced(REGISTRY["eagle3"](weights=str(root / "out" / "eagle3")), model, ids.tolist(), 3, 3)
    assert len(results) == 20 - 3 + 2 and not misses


def test_a_second_run_skips_finished_methods_and_extracts_new_records(chat, data_dir, recipe, tmp_path):
    model, tokenizer, engine = chat
    root, reports, settings = recipe
    import shutil

    more = tmp_path / "data"
    shutil.copytree(data_dir, more)
    generate_data(engine, SelfGenSettings(samples=32, **DATA), more, model_name="tiny", progress_bar=False)
    work = tmp_path / "work"
    shutil.copytree(root / "work", work)
    before = FeatureStore(work / "features")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversations, "HELD_OUT_EVERY", HELD_OUT_EVERY)
        again = run_recipe(model, tokenizer, **{**settings, "data_dir": more, "work_dir": work,
                                                "out_dir": tmp_path / "out",
                                                "recipe": RecipeSettings(methods="medusa")})
    after = FeatureStore(work / "features")
    assert after.manifest.records_done > before.manifest.records_done and len(after) > len(before)
    for row in range(len(before)):
        assert torch.equal(after.read(row, "layer.8"), before.read(row, "layer.8"))
    assert again["medusa"]["steps"] == reports["medusa"]["steps"]  # finished before: not trained again
    assert not (tmp_path / "out" / "medusa").exists()


def test_a_budget_can_count_cpu_time_and_does_not_bind_a_resumed_run():
    cpu = TrainSettings(minutes=5, budget_clock="cpu")
    assert cpu.schedule == TrainSettings(minutes=9).schedule  # a run may resume on the other clock
    with pytest.raises(ValueError, match="budget_clock"):
        TrainSettings(budget_clock="sundial")


def test_recipe_settings_refuse_unknown_methods():
    with pytest.raises(ValueError, match="methods"):
        RecipeSettings(methods="eagle3,lookahead")
    assert RecipeSettings(methods=" eagle3 , medusa").method_list == ["eagle3", "medusa"]
