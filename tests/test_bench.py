"""hasten bench: task construction, prompt files, the losslessness check, the report and the CLI.

Everything runs on tiny random models; nothing here asserts a timing.
"""
import json
import warnings

import pytest
import torch

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
               # fixed: it drafts every step (auto sizing may keep a random tiny draft model plain, by timing)
               hasten_method("draft_model", model, draft, draft_size="fixed", num_tokens=3),
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


def test_runner_prints_one_line_per_run_for_logs(models, capsys):
    """--progress lines: every run (warm-ups included) is one flushed stderr line, so a bench killed at
    a time limit still shows which runs finished and how long each took."""
    model, _ = models
    tasks, ids = small_tasks()
    methods = [hasten_method(AUTOREGRESSIVE, model), hasten_method("prompt_lookup", model)]
    run_bench(methods, tasks, ids, max_new_tokens=4, repeats=1, progress="lines")
    lines = capsys.readouterr().err.splitlines()
    total = len(methods) * (1 + len(tasks))
    assert len(lines) == total
    assert lines[0].startswith(f"bench [1/{total}] warm-up autoregressive: 4 tokens in ")
    assert lines[-1].startswith(f"bench [{total}/{total}] {tasks[-1].name} ")
    assert all(" tokens in " in line and line.endswith("tok/s)") for line in lines)


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
    assert ("| method | tok/s | vs AR | vs HF greedy | vs HF same path | tau | efficiency | target KV MB | "
            "drafter KV MB | note |") in md
    assert "draft_model (needs a draft model)" in md
    # per category, hasten's fastest method against Hugging Face's fastest
    from hasten.bench.report import best_per_category

    best = {b["category"]: b for b in best_per_category(results)}
    assert set(best) == {"repeat", "other", OVERALL}
    for category, b in best.items():
        rows = results["by_category"][category]
        assert b["hasten"]["tokens_per_second"] == max(r["tokens_per_second"] for r in rows[:2])
        assert b["hf"]["tokens_per_second"] == max(r["tokens_per_second"] for r in rows[2:])
        assert b["ratio"] == pytest.approx(b["hasten"]["tokens_per_second"] / b["hf"]["tokens_per_second"])
    assert "## hasten's best vs Hugging Face's best, per category" in md
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
    out, err = capsys.readouterr()
    assert "methods x 1 prompt x 1 repeat, 6 new tokens, 1 thread\n" in err  # no "1 threads"
    # the summary names the model and how it ran, tau, and the identity check
    summary = out.splitlines()
    model, draft = checkpoints
    assert summary[0] == f"hasten bench: {model} (float32 on cpu), draft {draft}; 1 prompt, 6 new tokens each, greedy"
    assert summary[1].split() == ["method", "tok/s", "vs", "AR", "tau", "identical", "to", "autoregressive"]
    rows = {line.split()[0]: line.split()[1:] for line in summary[2:-1]}
    assert set(rows) == set(names) and rows["autoregressive"][1:] == ["1.00x", "1.00", "1/1"]
    assert all(row[-1] == "1/1" for row in rows.values())
    assert summary[-1] == "every output was checked token for token against hasten's autoregressive: all identical"


def test_cli_bench_takes_the_dtypes_generate_takes(tmp_path, checkpoints, capsys):
    from hasten.arguments import DTYPES

    assert "int8" in DTYPES
    args = bench_args(checkpoints, tmp_path, "--tasks", "complete", "--methods", "autoregressive,prompt_lookup",
                      "--baselines", "hf_generate", "--dtype", "int8")
    assert main(args) == 0
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["dtype"] == "int8"
    out = capsys.readouterr().out
    assert "(int8 on cpu)" in out and out.splitlines()[-1].endswith("all identical")


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
        if self.complaint == "warn":  # a dependency's notice, say: not a reason to leave a method out
            warnings.warn("`an_option` is deprecated", FutureWarning)
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
    assert results["skipped"]["medusa"].startswith("no medusa weights found")  # untrained: its numbers would mislead
    timed = [m["name"] for m in results["methods"]]
    assert "prompt_lookup" in timed and "warner" in timed and "medusa" not in timed


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


def test_cli_bench_counts_differences_when_asked_and_records_device_and_dtype(tmp_path, checkpoints, monkeypatch,
                                                                             capsys):
    """--count-differences (for a GPU in bfloat16): a differing output is counted, not fatal."""
    import hasten.bench.cli as bench_cli

    real = bench_cli.hf_method
    monkeypatch.setattr(bench_cli, "hf_method", lambda name, model, draft=None: corrupted(real(name, model, draft), 2))
    args = bench_args(checkpoints, tmp_path, "--tasks", "complete", "--methods", "autoregressive",
                      "--baselines", "hf_generate", "--count-differences", "--dtype", "bfloat16")
    assert main(args) == 1  # counted and classified; a hasten method's defect still fails the run
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["method"]: row for row in results["by_category"][OVERALL]}
    assert rows["corrupt"]["identical"] == "0/1" and rows[AUTOREGRESSIVE]["identical"] == "1/1"
    assert [task.get("first_difference") for task in results["by_task"]] == [{"corrupt": 2}]  # planted at 2
    found = results["by_task"][0]["difference_classes"]["corrupt"]
    assert found["position"] == 2 and found["verdict"] == "defect" and found["gap"] > 0 and found["rank"] > 1
    assert found["rounding"] == 0.0  # bfloat16 blocks are invariant: a block gives the step's logits
    assert (results["settings"]["device"], results["settings"]["dtype"]) == ("cpu", "bfloat16")
    captured = capsys.readouterr()
    assert captured.out.splitlines()[-2] == (
        "outputs compared token for token with hasten's autoregressive and differences counted "
        "(--count-differences): corrupt differed on some prompts")
    assert captured.out.splitlines()[-1] == "  corrupt: first differences: 1 defect"
    assert "LOSSLESSNESS FAILURE: outputs differ beyond rounding: corrupt on complete-1 at new token 2" in captured.err
    assert "| complete-1 | corrupt | 2 |" in (tmp_path / "results.md").read_text()


def test_a_differing_token_is_a_near_tie_only_as_the_runner_up_within_rounding():
    from hasten.bench.differences import classify, verdict
    from helpers import hf_greedy

    assert verdict(0.01, 0.02) == "near-tie" and verdict(0.0, 0.0) == "near-tie"  # within rounding; a tie
    assert verdict(0.03, 0.02) == "defect"  # further below the top than any rounding measured
    model = tiny_model("llama")
    prompt = repetitive_prompt(12)
    reference = hf_greedy(model, prompt, 6, eos_token_id=None)[0, 12:].tolist()
    logits = model(torch.cat([prompt, torch.tensor([reference[:3]])], 1)).logits[0, -1]
    runner_up = int(logits.topk(2).indices[1])
    found = classify(model, prompt, reference, reference[:3] + [runner_up] + reference[4:], own_method=False)
    top = logits.topk(2).values
    assert found["position"] == 3 and found["rank"] == 1 and abs(found["gap"] - found["margin"]) < 1e-6
    assert abs(found["margin"] - float(top[0] - top[1])) < 1e-4 and found["rounding"] < 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised on a machine without CUDA")
def test_cli_bench_refuses_cuda_where_there_is_none(tmp_path, checkpoints, capsys):
    assert main(bench_args(checkpoints, tmp_path, "--device", "cuda")) == 2
    assert "--device cuda: CUDA is not available" in capsys.readouterr().err


# ---- chat tasks ----------------------------------------------------------------------------------
BOS = 1
CHAT_TEMPLATE = (  # writes its own BOS, as Llama's templates do, and EOS after each turn, as ChatML's do
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def chat_tokenizer():
    """The test tokenizer with a chat template, adding a BOS to plain text (as Llama's do)."""
    from tokenizers import processors

    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def test_every_chat_category_has_conversations_ending_with_a_user_turn():
    from hasten.bench.chat_tasks import CHAT_CATEGORIES, PROMPTS

    assert set(CHAT_CATEGORIES) == {"conversation", "translation", "summary", "qa", "math", "rag", "code_edit",
                                    "grammar"}
    for category in CHAT_CATEGORIES:
        assert len(PROMPTS[category]) >= 2, category
        for messages in PROMPTS[category]:
            roles = [m["role"] for m in messages]
            assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], category  # alternating
            assert all(m["content"].strip() for m in messages)
    # multi-turn: a prior exchange, then the new user turn
    assert all(len(messages) == 3 for messages in PROMPTS["conversation"])
    texts = [m["content"] for convs in PROMPTS.values() for ms in convs for m in ms]
    assert len(set(texts)) == len(texts)


def test_chat_tasks_go_through_the_chat_template():
    from hasten.bench.chat_tasks import CHAT_CATEGORIES, chat_tasks, task_input_ids

    tokenizer = chat_tokenizer()
    tasks = chat_tasks(tokenizer, per_task=2)
    assert [t.name for t in tasks] == [f"{c}-{j}" for c in CHAT_CATEGORIES for j in (1, 2)]
    for t in tasks:
        ids = task_input_ids(tokenizer, t)  # [1, T]
        expected = tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True, return_dict=True,
                                                 return_tensors="pt")["input_ids"]
        assert ids.tolist() == expected.tolist() and t.prompt_tokens == ids.shape[1]
        assert ids[0].tolist().count(BOS) == 1  # the template's BOS only, none added on top
        assert t.prompt.endswith("assistant:") and t.messages[-1]["content"] in t.prompt
    conversation = next(t for t in tasks if t.category == "conversation")
    assert f"assistant: {conversation.messages[1]['content']}</s>" in conversation.prompt
    # plain-text tasks keep the tokenizer's own encoding
    plain = Task("x-1", "x", "def add(a, b):")
    assert task_input_ids(tokenizer, plain).tolist() == [tokenizer("def add(a, b):").input_ids]
    firsts = [t for t in tasks if t.name in ("rag-1", "grammar-1")]
    assert chat_tasks(tokenizer, ["grammar", "rag"], per_task=1) == firsts


@pytest.mark.parametrize("kwargs, message", [
    ({"categories": ["poetry"]}, "unknown chat task categories"),
    ({"per_task": 99}, "--per-task must be between 1 and"),
])
def test_chat_tasks_reject_bad_requests(kwargs, message):
    from hasten.bench.chat_tasks import chat_tasks

    with pytest.raises(ValueError, match=message):
        chat_tasks(chat_tokenizer(), **kwargs)


def test_chat_tasks_are_plain_transcripts_without_a_chat_template():
    from hasten.bench.chat_tasks import PROMPTS, chat_tasks, task_input_ids

    tokenizer = tiny_tokenizer()  # a base model's: no chat template
    tasks = chat_tasks(tokenizer, ["conversation"], per_task=1)
    messages = PROMPTS["conversation"][0]
    assert [t.messages for t in tasks] == [()]
    assert tasks[0].prompt == (f"User: {messages[0]['content']}\n\nAssistant: {messages[1]['content']}\n\n"
                               f"User: {messages[2]['content']}\n\nAssistant:")
    assert task_input_ids(tokenizer, tasks[0]).shape[1] == tasks[0].prompt_tokens


def test_auto_tasks_are_chat_for_a_chat_model_and_code_otherwise():
    from hasten.bench.chat_tasks import CHAT_CATEGORIES
    from hasten.bench.cli import _builtin

    assert [t.category for t in _builtin("auto", chat_tokenizer(), 1)] == list(CHAT_CATEGORIES)
    assert [t.category for t in _builtin("auto", tiny_tokenizer(), 1)] == list(CATEGORIES)
    mixed = _builtin("grammar,edit", chat_tokenizer(), 1)
    assert [(t.name, bool(t.messages)) for t in mixed] == [("edit-1", False), ("grammar-1", True)]


def test_cli_bench_chat_tasks_end_to_end(tmp_path):
    path = tmp_path / "chat-model"
    # chat prompts are long in the test tokenizer's tokens: give the model room for them
    model = tiny_model("llama", max_position_embeddings=4096)
    # pad = EOS, as SmolLM2's: Hugging Face generate without an attention mask would mask out
    # the EOS tokens the template writes between turns, and differ from hasten
    model.generation_config.pad_token_id = model.config.eos_token_id
    model.save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    args = ["bench", "--model", str(path), "--tasks", "grammar,rag", "--per-task", "1", "--repeats", "1",
            "--max-new-tokens", "6", "--threads", "1", "--out", str(tmp_path / "out"), "--no-progress",
            "--methods", "autoregressive,prompt_lookup", "--baselines", "hf_generate,hf_prompt_lookup"]
    assert main(args) == 0  # 1 (and no results) on any mismatch with hasten autoregressive
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [t["name"] for t in results["tasks"]] == ["rag-1", "grammar-1"]
    assert all(t["messages"] and t["prompt"].endswith("assistant:") for t in results["tasks"])
    assert results["settings"]["chat_template"] is True
    assert set(results["by_category"]) == {"rag", "grammar", OVERALL}
    assert [r["method"] for r in results["by_category"][OVERALL]] == [
        AUTOREGRESSIVE, "prompt_lookup", "hf_generate", "hf_prompt_lookup"]
    assert "chat template" in (tmp_path / "out" / "results.md").read_text()


def test_hf_baselines_attend_to_prompt_tokens_equal_to_the_pad_id():
    """Chat templates write EOS between turns, and SmolLM2's pad id is its EOS id: the
    baselines must attend to those tokens as hasten does, not mask them out as padding."""
    model = tiny_model("llama")
    model.generation_config.pad_token_id = model.config.eos_token_id
    ids = repetitive_prompt(24, 0).clone()  # [1, 24]
    ids[0, 3::3] = model.config.eos_token_id  # as if every third token ended a turn
    reference, _, _ = hasten_method(AUTOREGRESSIVE, model).run(ids, 12)
    for name in ("hf_generate", "hf_prompt_lookup"):
        assert hf_method(name, model).run(ids, 12)[0] == reference, name


def test_hugging_face_baselines_must_match_in_float32_and_are_counted_below_it(models):
    """hasten equals Hugging Face's generate in float32; in bfloat16 each engine rounds its own way,
    so `hasten bench --dtype bfloat16` counts a differing hf_generate instead of stopping."""
    import copy

    model, _ = models
    assert hf_method("hf_generate", model).exact
    assert not hf_method("hf_generate", copy.deepcopy(model).to(torch.bfloat16)).exact
