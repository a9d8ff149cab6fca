"""Spec-Bench's questions in `hasten bench --tasks spec-bench`: the vendored file, its six
categories, first turns through the chat template, and the bench run end to end."""
import json

import pytest

from hasten.bench.spec_bench import CATEGORIES, MT_BENCH, QUESTIONS, spec_bench_tasks
from hasten.cli import main
from helpers import tiny_model, tiny_tokenizer
from test_chat import chat_tokenizer


def questions() -> dict[str, dict]:
    return {str(q["question_id"]): q for q in map(json.loads, QUESTIONS.read_text().splitlines())}


def test_the_vendored_file_is_spec_bench_with_its_licence():
    asked = questions()
    assert len(asked) == 480
    counts = {c: sum(q["category"] == c for q in asked.values()) for c in CATEGORIES[1:]}
    assert counts == dict.fromkeys(CATEGORIES[1:], 80)
    assert sum(q["category"] in MT_BENCH for q in asked.values()) == 80
    assert "Apache License" in (QUESTIONS.parent / "LICENSE").read_text()[:200]


def test_tasks_are_first_turns_through_the_chat_template_per_category():
    tokenizer = chat_tokenizer()
    asked = questions()
    tasks = spec_bench_tasks(tokenizer, 2)
    assert [t.category for t in tasks] == [c for c in CATEGORIES for _ in range(2)]
    for task in tasks:
        question = asked[task.name.removeprefix("spec-bench-")]
        assert task.messages == ({"role": "user", "content": question["turns"][0]},)
        assert task.prompt == tokenizer.apply_chat_template(list(task.messages), add_generation_prompt=True,
                                                            tokenize=False)
        assert (question["category"] in MT_BENCH) == (task.category == "conversation")
    conversation = [asked[t.name.removeprefix("spec-bench-")]["category"] for t in tasks[:2]]
    assert conversation == ["writing", "roleplay"]  # round-robin over MT-bench's categories
    every = spec_bench_tasks(tokenizer, 80)
    assert sorted(t.name for t in every) == sorted(f"spec-bench-{q}" for q in asked)


def test_a_base_model_gets_plain_transcripts_and_bad_counts_are_refused():
    tasks = spec_bench_tasks(tiny_tokenizer(), 1)
    assert not any(t.messages for t in tasks) and all(t.prompt.endswith("Assistant:") for t in tasks)
    for bad in (0, 81):
        with pytest.raises(ValueError, match="--per-task must be between 1 and 80 for spec-bench"):
            spec_bench_tasks(tiny_tokenizer(), bad)


def test_cli_bench_runs_spec_bench(tmp_path):
    path = tmp_path / "model"
    tiny_model("llama", max_position_embeddings=4096).save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    out = tmp_path / "out"
    assert main(["bench", "--model", str(path), "--tasks", "spec-bench", "--per-task", "1", "--repeats", "1",
                 "--max-new-tokens", "4", "--methods", "autoregressive,prompt_lookup", "--baselines", "none",
                 "--threads", "1", "--out", str(out), "--no-progress"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [t["category"] for t in results["tasks"]] == list(CATEGORIES)
    assert set(results["by_category"]) >= set(CATEGORIES)


def test_cli_bench_spec_bench_too_long_for_the_model_is_one_line(tmp_path, capsys):
    path = tmp_path / "model"
    tiny_model("llama").save_pretrained(path)  # 512 positions: a summarization question does not fit
    chat_tokenizer().save_pretrained(path)
    code = main(["bench", "--model", str(path), "--tasks", "spec-bench", "--per-task", "1", "--repeats", "1",
                 "--max-new-tokens", "4", "--baselines", "none", "--threads", "1", "--out", str(tmp_path / "o"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "task 'spec-bench-" in err and len(err.strip().splitlines()) == 1
