"""hasten bench: task construction, prompt files, the losslessness check, the report and the CLI.

Everything runs on tiny random models; nothing here asserts a timing.
"""
import json
import warnings

import pytest

from hasten.api import AUTOREGRESSIVE
from hasten.bench.report import write_report
from hasten.bench.runner import OVERALL, LosslessnessError, Method, hasten_method, hf_method, run_bench
from hasten.bench.tasks import CATEGORIES, LONG_CONTEXT_TOKENS, Task, builtin_tasks, read_prompts
from hasten.cli import main
from hasten.drafters.base import EMPTY_DRAFT, REGISTRY, Drafter

from helpers import repetitive_prompt, save_checkpoint, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def tasks(tokenizer):
    return builtin_tasks(tokenizer, per_task=2)


# ---- tasks --------------------------------------------------------------------------------
def test_builtin_tasks_are_deterministic(tokenizer, tasks):
    assert builtin_tasks(tokenizer, per_task=2) == tasks
    assert [t.name for t in tasks] == [f"{c}-{j}" for c in CATEGORIES for j in (1, 2)]
    assert len({t.prompt for t in tasks}) == len(tasks)
    # a category's prompts do not depend on which other categories are asked for
    assert builtin_tasks(tokenizer, ["edit"], per_task=2) == [t for t in tasks if t.category == "edit"]


def test_builtin_tasks_have_the_shape_of_their_category(tokenizer, tasks):
    by = {t.name: t for t in tasks}
    for t in tasks:
        assert t.prompt_tokens == len(tokenizer(t.prompt).input_ids)
    for j in (1, 2):
        complete, copy, edit, long = (by[f"{c}-{j}"] for c in CATEGORIES)
        assert long.prompt_tokens >= LONG_CONTEXT_TOKENS > complete.prompt_tokens
        # copy: the prompt ends by restating the start of a function given earlier in full
        head = copy.prompt.split("exactly as in the reference:\n", 1)[1]
        assert head and copy.prompt.index(head) < copy.prompt.rindex(head)
        # edit: the earlier block, then its start with one identifier renamed
        before, after = edit.prompt.split("\n# After renaming ", 1)
        old, new = after.split(":\n", 1)[0].split(" to ")
        assert new == f"new_{old}" and old in before
        # complete and long continue a function whose start ends the prompt
        for t in (complete, long):
            assert t.source.split()[-1] in t.prompt.splitlines()[-3]


def test_builtin_tasks_reject_unknown_categories(tokenizer):
    with pytest.raises(ValueError, match="unknown task categories"):
        builtin_tasks(tokenizer, ["poetry"])


# ---- prompt files ---------------------------------------------------------------------------
def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_prompts_takes_our_format_and_spec_bench(tmp_path, tokenizer):
    path = write_lines(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "def add(a, b):", "category": "code"}),
        "",
        json.dumps({"prompt": "for i in range(3):"}),
        json.dumps({"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]}),
        json.dumps({"prompt": "def sub(a, b):", "category": "code"}),
    ])
    tasks = read_prompts(path, tokenizer)
    assert [(t.name, t.category, t.prompt) for t in tasks] == [
        ("code-1", "code", "def add(a, b):"),
        ("custom-1", "custom", "for i in range(3):"),
        ("81", "writing", "Write a poem."),
        ("code-2", "code", "def sub(a, b):"),
    ]
    assert all(t.prompt_tokens > 0 for t in tasks)
    assert [t.name for t in read_prompts(path, tokenizer, per_task=1)] == ["code-1", "custom-1", "81"]


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "no prompt field"}', "expected a 'prompt'"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"turns": []}', "non-empty string"),
])
def test_read_prompts_names_the_bad_line(tmp_path, bad, message):
    path = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "ok"}), "", bad])
    with pytest.raises(ValueError, match=rf"p\.jsonl:3: .*{message}"):
        read_prompts(path)


# ---- runner -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models():
    return tiny_model("llama"), tiny_model("llama", seed=1)


def small_tasks():
    tasks = [Task("rep-1", "repeat", "-"), Task("rep-2", "repeat", "-"), Task("other-1", "other", "-")]
    return tasks, [repetitive_prompt(24, seed) for seed in range(3)]


def corrupted(method: Method, position: int) -> Method:
    """A method that gets one token wrong: what a lossy method would look like."""
    def run(input_ids, max_new_tokens):
        tokens, stats, seconds = method.run(input_ids, max_new_tokens)
        tokens[position] = (tokens[position] + 1) % 96
        return tokens, stats, seconds

    return Method("corrupt", "hasten", run)


def test_runner_checks_every_method_against_autoregressive(models):
    model, draft = models
    tasks, ids = small_tasks()
    methods = [hasten_method(AUTOREGRESSIVE, model), hasten_method("prompt_lookup", model),
               hasten_method("draft_model", model, draft, num_tokens=3),
               hf_method("hf_generate", model), hf_method("hf_prompt_lookup", model), hf_method("hf_assisted", model, draft)]
    out = run_bench(methods, tasks, ids, max_new_tokens=12, repeats=2, progress=False)
    assert set(out["by_category"]) == {"repeat", "other", OVERALL}
    rows = {r["method"]: r for r in out["by_category"][OVERALL]}
    assert list(rows) == [m.name for m in methods]
    assert all(r["tokens"] == 3 * 12 for r in rows.values())
    assert rows[AUTOREGRESSIVE]["speedup_vs_ar"] == 1.0 and rows[AUTOREGRESSIVE]["tau"] == 1.0
    assert rows["prompt_lookup"]["hf_match"] == "hf_prompt_lookup"
    assert rows["draft_model"]["hf_match"] == "hf_assisted"
    assert rows["hf_generate"]["tau"] == 1.0 and rows["hf_generate"]["speedup_vs_hf_generate"] == 1.0
    assert rows["hf_prompt_lookup"]["tau"] > 1  # counted from the target's forward calls
    assert rows["hf_assisted"]["acceptance_by_position"] is None and "median_draft_seconds" not in rows["hf_assisted"]
    assert rows["draft_model"]["median_draft_seconds"] > 0
    pl = rows["prompt_lookup"]
    assert pl["tau"] > 1  # the repetitive prompts let prompt lookup accept drafts
    assert pl["efficiency"] == pytest.approx(pl["speedup_vs_ar"] / pl["tau"], rel=1e-3)
    assert 1 <= len(rows["draft_model"]["acceptance_by_position"]) <= 3
    assert [t["task"] for t in out["by_task"]] == [t.name for t in tasks]


def test_runner_catches_a_planted_mismatch(models):
    model, _ = models
    tasks, ids = small_tasks()
    reference = hasten_method(AUTOREGRESSIVE, model)
    methods = [reference, corrupted(hasten_method("prompt_lookup", model), position=5)]
    with pytest.raises(LosslessnessError, match=r"corrupt differs .* task 'rep-1' at new token 5"):
        run_bench(methods, tasks, ids, max_new_tokens=8, repeats=1, progress=False)


def test_runner_needs_the_reference(models):
    tasks, ids = small_tasks()
    with pytest.raises(ValueError, match="autoregressive"):
        run_bench([hf_method("hf_generate", models[0])], tasks, ids, max_new_tokens=4, progress=False)


# ---- report ------------------------------------------------------------------------------------
def test_report_writes_json_markdown_and_charts(tmp_path, models):
    model, _ = models
    tasks, ids = small_tasks()
    methods = [hasten_method(AUTOREGRESSIVE, model), hasten_method("prompt_lookup", model),
               hf_method("hf_generate", model), hf_method("hf_prompt_lookup", model)]
    measured = run_bench(methods, tasks, ids, max_new_tokens=8, repeats=1, progress=False)
    from hasten.machine import machine_info

    results = {
        "command": "hasten bench --test", "date": "2026-01-01T00:00:00+00:00", "machine": machine_info(),
        "settings": {"model": "tiny", "draft": None, "max_new_tokens": 8, "repeats": 1},
        "tasks": [{"name": t.name, "category": t.category, "prompt_tokens": 24, "source": "test"} for t in tasks],
        "skipped": {"draft_model": "needs a draft model"}, **measured,
    }
    paths = write_report(results, tmp_path / "out")
    assert [p.name for p in paths] == ["results.json", "results.md", "speedup.png", "acceptance.png"]
    saved = json.loads(paths[0].read_text())
    assert {"command", "date", "machine", "settings", "tasks", "methods", "by_task", "by_category"} <= set(saved)
    assert {"cpu", "cores", "torch_threads", "gpu", "python", "torch", "transformers"} <= set(saved["machine"])
    md = paths[1].read_text()
    for heading in ("## repeat (2 prompts)", "## other (1 prompts)", f"## {OVERALL} (3 prompts)"):
        assert heading in md
    assert "| method | tok/s | vs AR | vs HF greedy | vs HF same path | tau | efficiency | note |" in md
    assert "draft_model (needs a draft model)" in md
    for png in paths[2:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_says_where_hasten_is_slower():
    from hasten.bench.report import _note

    kinds = {"prompt_lookup": "hasten", "hf_prompt_lookup": "hf"}
    row = {"method": "prompt_lookup", "speedup_vs_hf_generate": 1.5, "speedup_vs_hf_match": 0.8,
           "hf_match": "hf_prompt_lookup"}
    assert _note(row, kinds) == "**slower than hf_prompt_lookup**"
    assert _note({**row, "speedup_vs_hf_match": 1.2}, kinds) == ""
    assert _note({**row, "method": "hf_prompt_lookup"}, kinds) == ""


# ---- CLI -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return save_checkpoint(root / "model"), save_checkpoint(root / "draft", seed=1)


def bench_args(checkpoints, out, *extra):
    model, draft = checkpoints
    return ["bench", "--model", model, "--draft", draft, "--per-task", "1", "--repeats", "1",
            "--max-new-tokens", "6", "--threads", "1", "--out", str(out), "--no-progress", *extra]


def test_cli_bench_end_to_end(tmp_path, checkpoints, capsys):
    assert main(bench_args(checkpoints, tmp_path, "--tasks", "complete")) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    names = [m["name"] for m in results["methods"]]
    assert names[0] == AUTOREGRESSIVE and {"prompt_lookup", "draft_model"} <= set(names)
    assert {"hf_generate", "hf_prompt_lookup", "hf_assisted"} <= set(names)
    assert [t["name"] for t in results["tasks"]] == ["complete-1"]
    assert results["machine"]["torch_threads"] == 1
    assert set(results["by_category"]) == {"complete", OVERALL}
    assert all((tmp_path / f).is_file() for f in ("results.md", "speedup.png", "acceptance.png"))
    assert "tok/s" in capsys.readouterr().out


def test_cli_bench_with_a_prompt_file_and_chosen_methods(tmp_path, checkpoints):
    prompts = write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "def add(a, b):\n    return a + b\n"})])
    args = bench_args(checkpoints, tmp_path / "out", "--prompts", str(prompts), "--methods",
                      "autoregressive,prompt_lookup", "--baselines", "hf_generate", "--method-arg", "num_tokens=4")
    assert main(args) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [(m["name"], m["settings"]) for m in results["methods"]] == [
        (AUTOREGRESSIVE, {}), ("prompt_lookup", {"num_tokens": 4}), ("hf_generate", {})]
    assert [t["category"] for t in results["tasks"]] == ["custom"]


def test_cli_bench_without_baselines(tmp_path, checkpoints):
    args = bench_args(checkpoints, tmp_path, "--tasks", "complete", "--methods", "prompt_lookup", "--baselines", "none",
                      "--method-arg", "prompt_lookup.max_ngram=2")
    assert main(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(m["name"], m["settings"]) for m in results["methods"]] == [
        (AUTOREGRESSIVE, {}), ("prompt_lookup", {"max_ngram": 2})]  # the reference is added
    assert results["by_category"]["complete"][1]["speedup_vs_hf_generate"] is None


class _Unfit(Drafter):
    """A registered method that cannot serve these models: auto mode must leave it out."""

    complaint = "raise"

    def __init__(self):
        pass

    def begin(self, ctx):
        if self.complaint == "warn":
            warnings.warn("no trained heads found; using untrained ones")
        else:
            raise ValueError("needs an encoder-decoder target")

    def propose(self, ctx):
        return EMPTY_DRAFT


def test_cli_bench_auto_leaves_out_methods_that_do_not_fit(tmp_path, checkpoints, monkeypatch):
    monkeypatch.setitem(REGISTRY, "warner", type("Warner", (_Unfit,), {"complaint": "warn"}))
    monkeypatch.setitem(REGISTRY, "refuser", type("Refuser", (_Unfit,), {"complaint": "raise"}))
    assert main(bench_args(checkpoints, tmp_path, "--tasks", "complete", "--baselines", "none")) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["skipped"]["refuser"] == "needs an encoder-decoder target"
    assert results["skipped"]["warner"] == "no trained heads found; using untrained ones"
    assert "prompt_lookup" in [m["name"] for m in results["methods"]]


@pytest.mark.parametrize("extra, message", [
    (["--prompts", "BAD"], "p.jsonl:2: not valid JSON"),
    (["--methods", "autoregressive,teleport"], "unknown ['teleport']"),
    (["--method-arg", "warp=9"], "none of the methods"),
    (["--method-arg", "hf_generate.num_tokens=9"], "none of the methods"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--baselines", "hf_magic"], "--baselines: unknown ['hf_magic']"),
    (["--tasks", "complete,poetry"], "--tasks: unknown ['poetry']"),
])
def test_cli_bench_user_errors_are_one_line(tmp_path, checkpoints, capsys, extra, message):
    if extra[0] == "--prompts":
        extra = ["--prompts", str(write_lines(tmp_path / "p.jsonl", [json.dumps({"prompt": "x"}), "{oops"]))]
    assert main(bench_args(checkpoints, tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hasten: error:") and message in last and "Traceback" not in err


def test_cli_bench_fails_loudly_on_a_mismatch(tmp_path, checkpoints, capsys, monkeypatch):
    import hasten.bench.cli as bench_cli

    real = bench_cli.hf_method
    monkeypatch.setattr(bench_cli, "hf_method", lambda name, model, draft=None: corrupted(real(name, model, draft), 2))
    args = bench_args(checkpoints, tmp_path, "--tasks", "complete", "--methods", "autoregressive",
                      "--baselines", "hf_generate")
    assert main(args) == 1
    assert "LOSSLESSNESS FAILURE: corrupt differs" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
