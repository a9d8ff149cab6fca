"""Spec-Bench's questions in `hasten bench --tasks spec-bench`: the vendored file, its six
categories, first turns through the chat template, and the bench run end to end."""
import json

import pytest

import hasten
from hasten.bench.chat_tasks import task_input_ids
from hasten.bench.spec_bench import CATEGORIES, MT_BENCH, QUESTIONS, second_turns, spec_bench_tasks
from hasten.loading import load_model
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
    # the six first turns, then the conversation question's second turn after the model's own answer
    assert [t["category"] for t in results["tasks"]] == [*CATEGORIES, "conversation"]
    assert set(results["by_category"]) >= set(CATEGORIES)
    first, second = results["tasks"][0], results["tasks"][-1]
    assert second["name"] == first["name"] + "-turn2"
    question = questions()[first["name"].removeprefix("spec-bench-")]
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert [second["messages"][0]["content"], second["messages"][2]["content"]] == question["turns"]
    model, tokenizer = load_model(str(path)), chat_tokenizer()
    ids = task_input_ids(tokenizer, spec_bench_tasks(tokenizer, 1)[0])
    greedy = hasten.generate(model, ids, max_new_tokens=4).sequences[0, ids.shape[1]:].tolist()
    assert second["messages"][1]["content"] == tokenizer.decode(greedy, skip_special_tokens=True).strip()


def test_second_turns_follow_the_models_own_answer():
    tokenizer = chat_tokenizer()
    tasks = spec_bench_tasks(tokenizer, 2)
    answered = []

    def answer(task):
        answered.append(task.name)
        return f"answer to {task.name}"

    more = second_turns(tokenizer, tasks, answer)
    conversation = [t for t in tasks if t.category == "conversation"]
    assert answered == [t.name for t in conversation]  # only MT-bench's questions have a second turn
    assert [t.name for t in more] == [f"{t.name}-turn2" for t in conversation]
    for task, follow_up in zip(conversation, more):
        assert follow_up.category == "conversation"
        assert follow_up.messages[:2] == (task.messages[0], {"role": "assistant", "content": f"answer to {task.name}"})
        assert follow_up.messages[2]["content"] == questions()[task.name.removeprefix("spec-bench-")]["turns"][1]
        assert follow_up.prompt == tokenizer.apply_chat_template(list(follow_up.messages), add_generation_prompt=True,
                                                                 tokenize=False)


def test_cli_bench_spec_bench_too_long_for_the_model_is_one_line(tmp_path, capsys):
    path = tmp_path / "model"
    tiny_model("llama").save_pretrained(path)  # 512 positions: a summarization question does not fit
    chat_tokenizer().save_pretrained(path)
    code = main(["bench", "--model", str(path), "--tasks", "spec-bench", "--per-task", "1", "--repeats", "1",
                 "--max-new-tokens", "4", "--baselines", "none", "--threads", "1", "--out", str(tmp_path / "o"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "task 'spec-bench-" in err and len(err.strip().splitlines()) == 1
