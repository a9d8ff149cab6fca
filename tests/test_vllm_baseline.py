"""The vLLM baselines of ``hasten bench``: the worker protocol, the settings it passes to
vLLM, and how the runner counts another engine's outputs.

vLLM itself lives in its own environment (``make vllm``), absent from CI: here the worker
runs under this Python with a stand-in ``vllm`` package that records what it was given and
answers with the tokens it is told to. ``-m vllm`` runs the real one (tests/test_real_models.py
style: skipped unless its environment exists).
"""
import json
import textwrap
from pathlib import Path

import pytest

from hasten.api import AUTOREGRESSIVE
from hasten.arguments import UserError
from hasten.bench import vllm_cpu
from hasten.bench.runner import OVERALL, Method, hasten_method, run_bench
from hasten.bench.tasks import Task
from hasten.cli import main

from helpers import repetitive_prompt, save_checkpoint, tiny_model

STAND_IN = '''
import json, os
__version__ = "0.0-stand-in"
LOG = os.environ["STAND_IN_LOG"]
ANSWERS = json.loads(os.environ.get("STAND_IN_ANSWERS", "{}"))  # prompt's last id -> tokens

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class Metric:
    def __init__(self, name, value):
        self.name, self.value = name, value

class _Out:
    def __init__(self, ids):
        self.outputs = [type("C", (), {"token_ids": ids})()]

class LLM:
    def __init__(self, **kw):
        self.accepted = self.drafts = 0
        self.speculative = kw.get("speculative_config")
        exported = sorted(os.listdir(self.speculative["model"])) if (self.speculative or {}).get("method") == "medusa" else None
        with open(LOG, "a") as f:
            f.write(json.dumps({"llm": kw, "exported": exported,
                                "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))}}) + "\\n")

    def get_metrics(self):
        per_position = Metric("vllm:spec_decode_num_accepted_tokens_per_pos", None)
        per_position.values = [self.accepted, 0]  # every accepted draft token at position 1
        return [Metric("vllm:spec_decode_num_accepted_tokens", self.accepted),
                Metric("vllm:spec_decode_num_drafts", self.drafts), per_position]

    def generate(self, prompts, params, use_tqdm=False):
        prompt = prompts[0]["prompt_token_ids"]
        with open(LOG, "a") as f:
            f.write(json.dumps({"prompt": prompt, "params": params.kw}) + "\\n")
        print("vLLM chatter on stdout, which the protocol must skip")
        tokens = ANSWERS.get(str(prompt[-1]), [7] * params.kw["max_tokens"])[: params.kw["max_tokens"]]
        self.accepted += 2 if self.speculative else 0
        self.drafts += 4 if self.speculative else 0
        return [_Out(tokens)]
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(STAND_IN))
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    import sys

    monkeypatch.setenv(vllm_cpu.ENV_PYTHON, sys.executable)

    def records():
        return [json.loads(line) for line in log.read_text().splitlines()]

    return records


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


def reference_tokens(model, ids, n):
    return hasten_method(AUTOREGRESSIVE, model).run(ids, n)[0]


def test_vllm_baselines_run_the_model_directory_in_its_dtype_with_the_threads_asked(stand_in, checkpoint, monkeypatch):
    from hasten.loading import load_model

    model = load_model(checkpoint)
    ids = repetitive_prompt(16)
    right = reference_tokens(model, ids, 6)
    monkeypatch.setenv("STAND_IN_ANSWERS", json.dumps({str(ids[0, -1].item()): right}))
    plain = vllm_cpu.baseline_method("vllm", model, max_model_len=256, threads=1)
    ngram = vllm_cpu.baseline_method("vllm_ngram", model, max_model_len=256, threads=2)
    try:
        tokens, stats, seconds = plain.run(ids, 6)
        assert tokens == right and stats.steps == 6 and seconds >= 0
        tokens, stats, _ = ngram.run(ids, 6)
        assert tokens == right and stats.steps == 6 - 2  # each forward: one token plus the drafts accepted
    finally:
        plain.close()
        ngram.close()
    engines = [r for r in stand_in() if "llm" in r]
    assert [e["llm"]["dtype"] for e in engines] == ["float32", "float32"]  # never vLLM's bfloat16 downcast
    assert all(e["llm"]["model"] == str(__import__("pathlib").Path(checkpoint).resolve()) for e in engines)
    assert all(e["llm"]["enable_prefix_caching"] is False for e in engines)
    assert engines[0]["llm"].get("speculative_config") is None
    assert engines[1]["llm"]["speculative_config"] == vllm_cpu.SPECULATIVE["vllm_ngram"]
    assert engines[0]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert engines[1]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    requests = [r for r in stand_in() if "prompt" in r]
    assert requests[0]["prompt"] == ids[0].tolist()
    assert requests[0]["params"] == {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "detokenize": False,
                                     "structured_outputs": None}
    assert plain.settings["dtype"] == "float32" and plain.settings["vllm"] == "0.0-stand-in"


def test_another_engines_different_output_is_counted_not_fatal(models_and_ids):
    """vLLM's kernels may round a near-tie the other way: the run goes on and says on how
    many prompts its output was the reference."""
    model, ids = models_and_ids
    tasks = [Task("a-1", "a", "-"), Task("b-1", "b", "-")]
    right = reference_tokens(model, ids[0], 5)

    def run(input_ids, n):
        from hasten.core.stats import DecodeStats
        tokens = right if input_ids is ids[0] else [1] * n
        return list(tokens), DecodeStats(steps=n, new_tokens=n), 0.01

    other = Method("vllm", "vllm", run, exact=False)
    out = run_bench([hasten_method(AUTOREGRESSIVE, model), other], tasks, ids, max_new_tokens=5, repeats=1,
                    progress=False)
    rows = {r["method"]: r for r in out["by_category"][OVERALL]}
    assert rows["vllm"]["identical"] == "1/2" and rows[AUTOREGRESSIVE]["identical"] == "2/2"
    by_task = {t["task"]: {r["method"]: r["identical"] for r in t["rows"]} for t in out["by_task"]}
    assert by_task == {"a-1": {AUTOREGRESSIVE: "1/1", "vllm": "1/1"}, "b-1": {AUTOREGRESSIVE: "1/1", "vllm": "0/1"}}


@pytest.fixture(scope="module")
def models_and_ids():
    return tiny_model("llama"), [repetitive_prompt(16, seed) for seed in range(2)]


def test_bench_without_vllms_environment_says_how_to_get_it(tmp_path, checkpoint, monkeypatch, capsys):
    monkeypatch.setenv(vllm_cpu.ENV_PYTHON, str(tmp_path / "missing" / "python"))
    assert vllm_cpu.vllm_python() is None
    with pytest.raises(UserError, match="make vllm"):
        vllm_cpu.baseline_method("vllm", tiny_model("llama"), 256, 1)
    code = main(["bench", "--model", checkpoint, "--methods", AUTOREGRESSIVE, "--baselines", "vllm",
                 "--tasks", "complete", "--per-task", "1", "--max-new-tokens", "4", "--repeats", "1",
                 "--no-progress", "--out", str(tmp_path / "out")])
    assert code != 0 and "make vllm" in capsys.readouterr().err


def test_vllms_own_suffix_without_arctic_inference_says_how_to_build_it(stand_in, tmp_path, monkeypatch):
    """vLLM's hint names an arctic-inference release that does not fit vLLM 0.32; the baseline
    names the target that builds the one that does, before any engine starts."""
    with pytest.raises(UserError, match="make vllm-suffix"):
        vllm_cpu.baseline_method(vllm_cpu.VLLM_SUFFIX, tiny_model("llama"), 256, 1)
    suffix_decoding = tmp_path / "site" / "arctic_inference" / "suffix_decoding"
    suffix_decoding.mkdir(parents=True)
    (suffix_decoding.parent / "__init__.py").write_text("")
    (suffix_decoding / "__init__.py").write_text("")
    assert vllm_cpu.arctic_inference_in(vllm_cpu.vllm_python())


def test_bench_cli_times_the_vllm_baselines_beside_hasten(stand_in, checkpoint, tmp_path):
    code = main(["bench", "--model", checkpoint, "--methods", AUTOREGRESSIVE, "--baselines", "vllm,vllm_ngram",
                 "--tasks", "complete", "--per-task", "1", "--max-new-tokens", "4", "--repeats", "1",
                 "--no-progress", "--out", str(tmp_path / "out")])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {r["method"]: r for r in results["by_category"][OVERALL]}
    assert set(rows) == {AUTOREGRESSIVE, "vllm", "vllm_ngram"}
    assert rows["vllm"]["identical"] == "0/1"  # the stand-in answers 7s
    assert "output identical on 0/1 prompts" in (tmp_path / "out" / "results.md").read_text()
    assert {m["name"]: m["kind"] for m in results["methods"]}["vllm_ngram"] == "vllm"
    engines = [r for r in stand_in() if "llm" in r]
    assert len(engines) == 2 and all(e["llm"]["max_model_len"] >= 4 for e in engines)


def vllm_sized_model(tmp_path):
    """A tiny Llama saved where vLLM can load it, and loaded back: vLLM's CPU attention takes head
    sizes of 32 and up, not the usual tiny 8. Skips without vLLM's environment."""
    if vllm_cpu.vllm_python() is None:
        pytest.skip("vLLM's environment is not installed: make vllm")
    from hasten.loading import load_model

    from helpers import tiny_tokenizer

    path = tmp_path / "heads64"
    tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path, load_model(str(path))


def run_vllm(model, names, ids, new_tokens) -> dict:
    """Each named vLLM baseline's (tokens, stats, seconds) on one prompt, its worker closed after."""
    outputs = {}
    for name in names:
        method = vllm_cpu.baseline_method(name, model, max_model_len=256, threads=1)
        try:
            outputs[name] = method.run(ids, new_tokens)
        finally:
            method.close()
    return outputs


@pytest.mark.vllm
def test_real_vllm_float32_greedy_equals_hasten_on_a_tiny_model(tmp_path):
    _, model = vllm_sized_model(tmp_path)
    ids = repetitive_prompt(16)
    tokens, _, _ = run_vllm(model, ["vllm"], ids, 8)["vllm"]
    assert tokens == reference_tokens(model, ids, 8)


def test_vllm_medusa_runs_hastens_heads_exported_and_reports_acceptance_per_position(stand_in, tmp_path):
    """vllm_medusa: the model's trained heads (beside it) exported into a folder vLLM is given,
    removed afterwards; vLLM's per-position counters become the row's acceptance; not in auto."""
    from hasten.drafters.medusa import MedusaHeads
    from hasten.loading import load_model

    model_dir = Path(save_checkpoint(tmp_path / "tiny"))
    MedusaHeads.for_target(load_model(str(model_dir)), 2).save(model_dir / "medusa")
    code = main(["bench", "--model", str(model_dir), "--methods", AUTOREGRESSIVE, "--baselines", "vllm_medusa",
                 "--tasks", "complete", "--per-task", "1", "--max-new-tokens", "4", "--repeats", "1",
                 "--no-progress", "--out", str(tmp_path / "out")])
    assert code == 0
    engine = next(r for r in stand_in() if "llm" in r)
    speculative = engine["llm"]["speculative_config"]
    assert (speculative["method"], speculative["num_speculative_tokens"]) == ("medusa", 2)
    assert engine["exported"] == ["config.json", "model.safetensors"]
    assert not Path(speculative["model"]).exists()  # the temporary export is gone after the run
    rows = {r["method"]: r for r in json.loads((tmp_path / "out" / "results.json").read_text())["by_category"][OVERALL]}
    assert rows["vllm_medusa"]["acceptance_by_position"] == [0.5, 0.0]  # 2 of 4 drafts accepted at position 1


def test_vllm_medusa_is_asked_for_by_name_only(stand_in, checkpoint, tmp_path):
    assert main(["bench", "--model", checkpoint, "--methods", AUTOREGRESSIVE, "--baselines", "auto",
                 "--tasks", "complete", "--per-task", "1", "--max-new-tokens", "2", "--repeats", "1",
                 "--no-progress", "--out", str(tmp_path / "out")]) == 0
    names = {m["name"] for m in json.loads((tmp_path / "out" / "results.json").read_text())["methods"]}
    assert "vllm" in names and "vllm_medusa" not in names


# ---- hasten.vllm: hasten's prompt lookup as a vLLM proposer -------------------------------------
def vllm_config(depth: int, max_model_len: int = 64):
    from types import SimpleNamespace

    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=depth),
                           model_config=SimpleNamespace(max_model_len=max_model_len))


def hasten_draft(tokens: list[int], depth: int) -> list[int]:
    from hasten.core.sampling import Sampling
    from hasten.drafters.base import DraftContext
    from hasten.drafters.prompt_lookup import PromptLookup

    drafter = PromptLookup(num_tokens=depth)
    ctx = DraftContext(list(tokens), depth, Sampling(), None, None, None)
    ctx.state = drafter.begin(ctx)
    return list(drafter.propose(ctx).tokens)


def test_the_vllm_proposer_drafts_what_hastens_prompt_lookup_drafts():
    """Row by row and step by step, as vLLM calls it: rows growing, a row taken over by a new
    request, a row still prefilling (nothing sampled), a row with no room left (at a fixed
    depth: tests/test_vllm_proposers.py sizes it)."""
    import numpy as np

    from hasten.vllm import FixedPromptLookup

    proposer = FixedPromptLookup(vllm_config(depth=4, max_model_len=40))
    proposer.load_model()
    rng = np.random.default_rng(0)
    story = [int(t) for t in rng.integers(5, 12, size=40)]  # a small alphabet: many repeats
    other = [int(t) for t in rng.integers(20, 24, size=30)]
    table = np.zeros((3, 40), dtype=np.int64)
    checked = 0
    for length in range(3, 30):
        rows = [story[:length], other[: length + 2] if length < 12 else story[: length + 7], other[:5]]
        for i, tokens in enumerate(rows):
            table[i, : len(tokens)] = tokens
        sampled = [[tokens[-1]] for tokens in rows[:2]] + [[]]  # row 2 is still prefilling
        drafts = proposer.propose(sampled, np.array([len(t) for t in rows]), table)
        assert drafts[2] == []
        for tokens, draft in zip(rows[:2], drafts[:2]):
            room = min(4, 40 - len(tokens))
            assert draft == hasten_draft(tokens, room)[:room]
            checked += bool(draft)
    assert checked > 20  # drafts were really made and compared
    full = story[:38]
    table[0, :38] = full
    assert proposer.propose([[full[-1]]], np.array([38]), table)[0] == hasten_draft(full, 2)  # 2 positions left
    assert proposer.propose([[1]], np.array([40]), table) == [[]]


@pytest.mark.vllm
def test_real_vllm_with_hastens_proposers_decodes_as_vllm_alone(tmp_path):
    """vLLM verifies hasten's drafts itself: with each of hasten's proposers (prompt lookup sized
    per request and at a fixed depth, lookahead's chain) its greedy output is its plain
    decoding's, and drafts were accepted (a repeating prompt)."""
    _, model = vllm_sized_model(tmp_path)
    ids = repetitive_prompt(24)
    proposers = ["vllm_prompt_lookup", "vllm_prompt_lookup_fixed", "vllm_lookahead"]
    outputs = run_vllm(model, ["vllm", *proposers], ids, 24)
    for name in proposers:
        assert outputs[name][0] == outputs["vllm"][0] == reference_tokens(model, ids, 24), name
        assert outputs[name][1].steps < 24, name  # some drafts were accepted


@pytest.mark.vllm
def test_real_vllm_runs_hastens_exported_medusa_as_hasten_does(tmp_path):
    """The round trip of issue 28: vLLM loads hasten's Medusa export, its greedy output is its plain
    decoding's, and it accepts at each draft position what hasten's own top-1 chain accepts
    (a layout or offset mistake shows as acceptance near zero)."""
    from hasten.api import make_drafter
    from hasten.drafters.medusa import MedusaHeads
    from hasten.engine.loop import generate

    path, model = vllm_sized_model(tmp_path)
    MedusaHeads.for_target(model, 3).save(path / "medusa")  # untrained: each head repeats the target's guess
    ids = repetitive_prompt(24)
    ours = generate(model, ids, drafter=make_drafter("medusa", None, top_k=1, tree_size=3), max_new_tokens=32,
                    eos_token_id=[], draft_size="fixed").stats
    outputs = run_vllm(model, ["vllm", "vllm_medusa"], ids, 32)
    assert outputs["vllm_medusa"][0] == outputs["vllm"][0] == reference_tokens(model, ids, 32)
    theirs = outputs["vllm_medusa"][1]
    assert ours.accepted_tokens > 0  # the chain is accepted somewhere, so a broken export would show
    assert theirs.accepted_at_depth == ours.accepted_at_depth[:3] + [0] * (3 - len(ours.accepted_at_depth))
    assert abs(theirs.drafted_at_depth[0] - ours.drafted_at_depth[0]) <= 1  # vLLM may skip the last step's draft
