"""``hasten bench --backend llama.cpp``: hasten's methods on the llama.cpp backend timed with
llama.cpp's own decoding of the same GGUF in one interleaved run, every output checked equal.

Needs llama-cpp-python (``pip install 'hasten[llamacpp]'``, see docs/cpu.md); the GGUF is the
tiny random Llama that tests/test_llamacpp.py writes."""
from __future__ import annotations

import json

import pytest

pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed: pip install 'hasten[llamacpp]' (see docs/cpu.md)")
from test_llamacpp import NEW, llama_cpp_greedy, tiny_gguf  # noqa: E402,F401  (the fixture, by name)

from hasten.bench import llamacpp  # noqa: E402

PROMPTS = [
    {"prompt": "def add(a, b):\n    return a + b\ndef add(a, b):\n", "category": "code"},
    {"prompt": "for i in range(10):\n    print(i)\nfor i in range(10):\n", "category": "loop"},
]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in PROMPTS))
    return str(path)


def bench(cli, gguf, prompts, out, *more):
    return cli("bench", "--backend", "llama.cpp", "--model", str(gguf), "--prompts", prompts, "--per-task", "1",
               "--repeats", "2", "--max-new-tokens", str(NEW), "--out", str(out), "--no-progress", *more)


def test_the_bench_times_hasten_and_llama_cpp_on_one_gguf_with_equal_tokens(cli, tiny_gguf, prompts, tmp_path):
    """Every method's tokens equal hasten's plain decoding on llama.cpp (the runner stops
    otherwise) and llama-cpp-python's greedy loop is one of them, so all equal llama.cpp's
    greedy; the baselines run on the same file and threads. llama.cpp's loop also runs with
    flash attention off (llama-cpp-python's default), named so and timed, its tokens counted."""
    code, printed, err = bench(cli, tiny_gguf, prompts, tmp_path / "out", "--draft", str(tiny_gguf))
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    kinds = {m["name"]: m["kind"] for m in results["methods"]}
    expected = {"autoregressive": "hasten", "prompt_lookup": "hasten", "lookahead": "hasten", "draft_model": "hasten",
                "llama_cpp": "llama.cpp", "llama_cpp_noflash": "llama.cpp"}
    if llamacpp.lookup_available():
        expected["llama_cpp_lookup"] = "llama.cpp"
    assert kinds == expected
    assert results["settings"]["backend"] == "llama.cpp"
    baselines = {m["name"]: m for m in results["methods"] if m["kind"] == "llama.cpp"}
    assert baselines["llama_cpp"]["settings"]["threads"] == 1 == baselines["llama_cpp_noflash"]["settings"]["threads"]
    assert baselines["llama_cpp"]["settings"]["flash_attn"] is True and baselines["llama_cpp"]["exact"] is True
    # flash off writes llama.cpp's other rounding: not the reference, its outputs counted
    assert baselines["llama_cpp_noflash"]["settings"]["flash_attn"] is False
    assert baselines["llama_cpp_noflash"]["exact"] is False
    rows = {r["method"]: r for r in results["by_category"]["overall"]}
    assert all(rows[m]["tokens"] == NEW * len(PROMPTS) for m in expected)
    assert rows["draft_model"]["tau"] > 1 and rows["prompt_lookup"]["tau"] > 1  # drafts were accepted
    assert rows["llama_cpp"]["tau"] == rows["llama_cpp_noflash"]["tau"] == 1.0  # an eval a token, the prompt's first
    assert "llama_cpp" in printed
    # hasten is set against llama.cpp: its plain decoding and, for prompt lookup, llama.cpp's own
    for method in ("autoregressive", "prompt_lookup"):
        row = rows[method]
        for loop in ("llama_cpp", "llama_cpp_noflash"):
            assert row[f"speedup_vs_{loop}"] == pytest.approx(rows[loop]["seconds"] / row["seconds"], rel=1e-3)
    if llamacpp.lookup_available():
        assert rows["prompt_lookup"]["hf_match"] == "llama_cpp_lookup"
    assert rows["autoregressive"]["hf_match"] == "llama_cpp"
    report = (tmp_path / "out" / "results.md").read_text()
    assert "| vs llama.cpp greedy (flash on) | vs llama.cpp greedy (flash off) |" in report
    assert "hasten's best vs llama.cpp's best" in report
    assert "llama_cpp (flash attention on), llama_cpp_noflash (flash attention off)" in report
    assert "but llama_cpp_noflash's, compared and counted" in report


def with_last_token_changed(baseline_method, changed: str):
    """``baseline_method`` whose ``changed`` baseline writes its last token one id higher."""
    def method_for(name, model):
        method = baseline_method(name, model)
        if name != changed:
            return method
        inner = method.run

        def run(input_ids, max_new_tokens):
            tokens, stats, seconds = inner(input_ids, max_new_tokens)
            return tokens[:-1] + [(tokens[-1] + 1) % model.vocab_size], stats, seconds

        method.run = run
        return method
    return method_for


def test_a_baseline_that_differs_stops_the_bench(cli, tiny_gguf, prompts, tmp_path, monkeypatch):
    """The llama.cpp baselines go through the same check as hasten's methods: one token off
    fails the run."""
    monkeypatch.setattr(llamacpp, "baseline_method", with_last_token_changed(llamacpp.baseline_method, "llama_cpp"))
    code, _, err = bench(cli, tiny_gguf, prompts, tmp_path / "out", "--methods", "prompt_lookup",
                         "--baselines", "llama_cpp")
    assert code == 1 and "LOSSLESSNESS FAILURE" in err and "llama_cpp" in err


def test_the_flash_off_loop_writing_other_text_is_counted_not_fatal(cli, tiny_gguf, prompts, tmp_path, monkeypatch):
    """Without flash attention llama.cpp may write other text (docs/cpu.md): the run goes on,
    and the tables say on how many prompts its output was the reference's."""
    monkeypatch.setattr(llamacpp, "baseline_method",
                        with_last_token_changed(llamacpp.baseline_method, "llama_cpp_noflash"))
    code, printed, err = bench(cli, tiny_gguf, prompts, tmp_path / "out", "--methods", "prompt_lookup",
                               "--baselines", "llama_cpp,llama_cpp_noflash")
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    rows = {r["method"]: r for r in results["by_category"]["overall"]}
    assert rows["llama_cpp_noflash"]["identical"] == "0/2" and rows["llama_cpp"]["identical"] == "2/2"
    assert [task["first_difference"] for task in results["by_task"]] == [{"llama_cpp_noflash": NEW - 1}] * 2
    assert "| llama_cpp_noflash |" in (tmp_path / "out" / "results.md").read_text()
    assert "output identical on 0/2 prompts" in (tmp_path / "out" / "results.md").read_text()
    assert "llama.cpp without flash attention): llama_cpp_noflash differed on some prompts" in printed


def test_the_reference_is_llama_cpps_greedy_decoding(tiny_gguf):
    """The plain loop on llama.cpp, as the bench runs it, gives llama.cpp's own greedy tokens."""
    import torch

    from hasten.bench.runner import hasten_method

    model = llamacpp.load(tiny_gguf, 1, 512)
    prompt = list(range(5, 17)) * 2
    tokens, stats, _ = hasten_method("autoregressive", model).run(torch.tensor([prompt]), NEW)
    assert tokens == llama_cpp_greedy(tiny_gguf, prompt, NEW, 512)
    plain, _, _ = llamacpp.baseline_method("llama_cpp", model).run(torch.tensor([prompt]), NEW)
    assert plain == tokens
    flash_off, stats, _ = llamacpp.baseline_method("llama_cpp_noflash", model).run(torch.tensor([prompt]), NEW)
    assert len(flash_off) == stats.new_tokens == NEW  # its tokens are timed, not the reference


def test_the_bench_times_auto_and_fixed_sizing_on_llama_cpp(cli, tiny_gguf, prompts, tmp_path, monkeypatch):
    """--draft-size auto,fixed on the llama.cpp backend: each method both ways (auto with the
    file's own calibrated curve, timed into a fresh cache), every output equal to llama.cpp's."""
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path / "cache"))
    code, _, err = bench(cli, tiny_gguf, prompts, tmp_path / "out", "--methods", "prompt_lookup",
                         "--baselines", "llama_cpp", "--draft-size", "auto,fixed")
    assert code == 0, err
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    sizes = {m["name"]: m.get("draft_size") for m in results["methods"]}
    assert sizes["prompt_lookup"] == "auto" and sizes["prompt_lookup@fixed"] == "fixed"
    assert list((tmp_path / "cache" / "cost").glob("*.json"))  # llama.cpp's curve, timed and cached


@pytest.mark.parametrize("args, match", [
    (["--methods", "medusa"], "medusa needs hidden states, torch modules, which the llama.cpp runtime"),
    (["--baselines", "hf_generate"], "known: llama_cpp, llama_cpp_noflash, llama_cpp_lookup"),
])
def test_bench_options_that_cannot_run_on_llama_cpp_fail_in_one_line(cli, tiny_gguf, prompts, tmp_path, args, match):
    code, _, err = bench(cli, tiny_gguf, prompts, tmp_path / "out", *args)
    assert code == 2 and match in err and err.count("\n") == 1, err


def test_a_model_that_is_no_gguf_is_named(cli, prompts, tmp_path):
    from helpers import save_checkpoint

    path = save_checkpoint(tmp_path / "ckpt")
    code, _, err = bench(cli, path, prompts, tmp_path / "out")
    assert code == 2 and "needs a .gguf file" in err


def test_record_and_replay_on_llama_cpp_take_the_real_run_s_steps(cli, tiny_gguf, prompts, tmp_path):
    """A llama.cpp recording verifies chains only, and replaying prompt lookup over it takes
    exactly the steps hasten takes on llama.cpp itself."""
    import torch

    from hasten.bench.replay import Recording, replay
    from hasten.drafters import PromptLookup
    from hasten.engine.loop import generate
    from hasten.engine.sizing import FixedSize

    path = tmp_path / "rec.json"
    code, _, err = cli("record", "--backend", "llama.cpp", "--model", str(tiny_gguf), "--prompts", prompts,
                       "--per-task", "1", "--max-new-tokens", str(NEW), "--out", str(path), "--no-progress")
    assert code == 0, err
    recording = Recording.load(path)
    assert recording.backend == "llama.cpp" and not recording.trees_ok
    model = llamacpp.load(str(tiny_gguf), 1, 256)
    for entry in recording.entries:
        real = generate(model, torch.tensor([entry.prompt]), drafter=PromptLookup(), max_new_tokens=NEW,
                        eos_token_id=[], draft_size="fixed")
        replayed = replay(recording, entry, PromptLookup(), FixedSize())
        assert replayed.tokens == real.sequences[0, len(entry.prompt):].tolist() == entry.output
        assert (replayed.stats.steps, replayed.stats.accepted_at_depth) == (real.stats.steps,
                                                                            real.stats.accepted_at_depth)
        assert replayed.stats.steps < NEW  # prompt lookup's drafts were accepted
