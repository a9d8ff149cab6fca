"""The model zoo: name resolution, corpus split, the shipped tokenizer and models, and the
training recipe itself on a minuscule model (no retraining of the shipped weights)."""
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hasten import zoo
from hasten.zoo import corpus, recipe

CODE = "class A:\n\tdef f(self, x):\n\t\treturn  x , 'é'  # tab, double space\n\n\n    pass\r\n  "


# ---------------------------------------------------------------- names


def test_resolve_accepts_prefixed_and_bare_names():
    for name in zoo.MODELS:
        path = zoo.resolve(zoo.ZOO_PREFIX + name)
        assert path == zoo.resolve(name) and path.name == name  # the unpacked copy (hasten.zoo.packing)
        assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_resolve_rejects_unknown_names_and_lists_known_ones():
    with pytest.raises(ValueError, match="code-tiny-draft"):
        zoo.resolve("zoo:no-such-model")


def test_resolve_explains_how_to_train_missing_weights(monkeypatch, tmp_path):
    monkeypatch.setattr(zoo, "WEIGHTS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="python -m hasten.zoo.recipe all"):
        zoo.resolve("zoo:code-tiny")
    with pytest.raises(FileNotFoundError, match="python -m hasten.zoo.vlm_recipe"):
        zoo.resolve("zoo:vlm-tiny")


def test_is_zoo_name():
    assert zoo.is_zoo_name("zoo:code-tiny")
    assert not zoo.is_zoo_name("code-tiny") and not zoo.is_zoo_name("/models/zoo:x")


# ---------------------------------------------------------------- corpus


def test_corpus_split_is_deterministic_disjoint_and_small():
    train, heldout = corpus.training_files(), corpus.heldout_files()
    assert train == corpus.training_files() and heldout == corpus.heldout_files()
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == sorted(corpus.all_files())
    assert 0.01 < len(heldout) / (len(train) + len(heldout)) < 0.06


def test_heldout_choice_depends_only_on_the_path():
    # sha256-based, so these answers hold in every process, on every machine and Python version.
    assert [corpus.is_heldout(p) for p in ("fnmatch.py", "pprint.py", "ast.py", "json/decoder.py")] == [
        True, True, False, False]
    flags = [corpus.is_heldout(f"pkg/mod{i}.py") for i in range(2000)]
    assert 0.01 < sum(flags) / len(flags) < 0.06


def test_corpus_skips_tests_and_sorts_by_relative_path(tmp_path):
    for rel in ("b.py", "a/z.py", "a/tests/t.py", "test/x.py", "lib2to3/tests/data/bad.py",
                "idlelib/i.py", "site-packages/p/q.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert [p.relative_to(tmp_path).as_posix() for p in corpus.all_files(tmp_path)] == ["a/z.py", "b.py"]


def test_read_text_survives_invalid_utf8(tmp_path):
    (tmp_path / "bad.py").write_bytes(b"s = '\xff'\n")
    assert corpus.read_text(tmp_path / "bad.py") == "s = '\ufffd'\n"


# ---------------------------------------------------------------- shipped tokenizer and models


def text_models() -> list[str]:
    """The zoo's causal text models (vlm-tiny is a LLaVA: tests/test_vlm_recipe.py)."""
    return [name for name in zoo.MODELS
            if json.loads((zoo.resolve(name) / "config.json").read_text())["architectures"][0].endswith("ForCausalLM")]


@pytest.fixture(scope="module")
def shipped():
    """{name: (model, tokenizer, training report)} for every zoo text model."""
    out = {}
    for name in text_models():
        path = zoo.resolve(name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = (model, AutoTokenizer.from_pretrained(path), json.loads((path / "training.json").read_text()))
    return out


def test_shipped_tokenizer_round_trips_code_exactly(shipped):
    for _, tokenizer, _ in shipped.values():
        ids = tokenizer.encode(CODE, add_special_tokens=False)
        assert tokenizer.decode(ids) == CODE
        assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == recipe.EOT
        assert tokenizer.eos_token_id == 0


def test_target_and_draft_share_one_tokenizer():
    files = [(zoo.resolve(name) / "tokenizer.json").read_bytes() for name in text_models()]
    assert files[0] == files[1]


@pytest.mark.parametrize("name, low, high", [("code-tiny", 5e6, 7e6), ("code-tiny-draft", 0.5e6, 1.2e6)])
def test_shipped_model_shape(shipped, name, low, high):
    model, tokenizer, report = shipped[name]
    n_params = sum(p.numel() for p in model.parameters())
    assert low <= n_params <= high and report["params"] == n_params
    assert model.config.vocab_size == len(tokenizer) == recipe.VOCAB_SIZE
    assert model.config.tie_word_embeddings
    assert model.generation_config.eos_token_id == model.config.eos_token_id == tokenizer.eos_token_id


def test_target_learned_something(shipped):
    report = shipped["code-tiny"][2]
    losses = [e["heldout_loss"] for e in report["heldout"]]
    assert losses[-1] < losses[0] and losses[-1] < math.log(recipe.VOCAB_SIZE)


def test_greedy_generation_decodes_to_text(shipped):
    model, tokenizer, _ = shipped["code-tiny"]
    prompt = "import os\n\n\ndef main():\n"
    ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt_len]
    out = model.generate(ids, max_new_tokens=16, do_sample=False)  # [1, prompt_len + new]
    text = tokenizer.decode(out[0])
    assert out.shape[1] > ids.shape[1] and isinstance(text, str) and text.startswith(prompt)


# ---------------------------------------------------------------- the recipe on a minuscule model


def test_recipe_trains_saves_and_resumes_a_minuscule_model(tmp_path):
    files = []
    for i in range(4):
        files.append(tmp_path / f"m{i}.py")
        files[-1].write_text(f"def f{i}(x):\n\treturn x + {i}\n\n\nclass C{i}:\n    pass\n" * 20)
    tokenizer = recipe.train_tokenizer(files, vocab_size=300)
    assert tokenizer.decode(tokenizer.encode(CODE, add_special_tokens=False)) == CODE
    stream = recipe.token_stream(tokenizer, files, tmp_path / "work")  # [n_tokens]
    assert (recipe.token_stream(tokenizer, files, tmp_path / "work") == stream).all()  # from the cache
    shape = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=32)
    settings = recipe.Settings(minutes=1.0, batch_size=2, seq_len=16, warmup_steps=2, eval_windows=2, max_steps=3)

    def train(s):
        model = recipe.build_model(recipe.model_config(shape, tokenizer), seed=0)
        return recipe.train_model("mini", model, tokenizer, stream, stream, tmp_path / "out",
                                  tmp_path / "ckpt", s)

    first = train(settings)
    assert first["steps"] == 3 and first["tokens_seen"] == 3 * 2 * 16
    settings.max_steps, settings.resume = 5, True
    resumed = train(settings)
    assert resumed["steps"] == 5 and resumed["heldout"][:2] == first["heldout"]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    assert AutoTokenizer.from_pretrained(tmp_path / "out").decode(stream[:20].tolist()) == tokenizer.decode(stream[:20].tolist())
    saved = json.loads((tmp_path / "out" / "training.json").read_text())
    assert saved["steps"] == 5 and saved["machine"]["cpu"] and saved["machine"]["torch"] == torch.__version__


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    s = recipe.Settings(minutes=1.0, lr=1e-3, warmup_steps=10, final_lr_ratio=0.1)
    def lr_at(step, progress):
        return s.lr * recipe.lr_schedule(s).scale(step, time_share=progress)

    assert lr_at(0, 0.0) == pytest.approx(1e-4)
    assert lr_at(9, 0.0) == pytest.approx(1e-3)
    assert lr_at(500, 0.5) == pytest.approx(0.55e-3)
    assert lr_at(1000, 1.0) == lr_at(1001, 1.3) == pytest.approx(1e-4)
