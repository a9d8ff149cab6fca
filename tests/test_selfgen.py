"""Self-generated training data (hasten.training.selfgen): the model writes its user turns and
answers; nothing of the benchmark gets in; a stopped run resumes to the data one run writes."""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest
import torch

from helpers import CHAT_EOS as EOS, chat_model, tiny_tokenizer
from hasten.training.selfgen import SelfGenSettings, generate_data, open_progress, read_records, training_pairs
from hasten.training.textcheck import NgramIndex, bench_overlap, bench_texts, degenerate
from hasten.training.selfgen import BENCH_OVERLAP

TINY = dict(seed=3, batch=4, chunk=4, user_tokens=40, answer_tokens=10, dtype="float32", followup_share=0.5)


@pytest.fixture(scope="module")
def engine():
    """A tiny random chat model whose end-of-turn token is likely (a bias on its LM head), so
    that some of its user turns end and are kept."""
    from hasten.api import load

    model, tokenizer = chat_model(eos_bias=0.8)
    return load(model, "autoregressive", tokenizer=tokenizer, threads=1)


def lines(out_dir) -> list[dict]:
    return list(read_records(out_dir))


# ---- what a run writes ----------------------------------------------------------------------------
def test_a_run_writes_conversations_of_the_models_own_turns(engine, tmp_path):
    progress = generate_data(engine, SelfGenSettings(samples=16, **TINY), tmp_path, model_name="tiny",
                             progress_bar=False)
    records = lines(tmp_path)
    assert progress.next_index == 16 and progress.records == len(records) >= 3
    assert len(records) + sum(v for k, v in progress.dropped.items() if not k.startswith("follow-up")) == 16
    assert [r["index"] for r in records] == sorted({r["index"] for r in records})
    assert {r["mode"] for r in records} <= {"greedy", "sampled"}
    for record in records:
        roles = [m["role"] for m in record["messages"] if m["role"] != "system"]
        assert roles[::2] == ["user"] * len(roles[::2]) and roles[1::2] == ["assistant"] * len(roles[1::2])
        assert len(record["answers"]) == len(record["finish"]) == roles.count("assistant") >= 1
        for prompt, answer in training_pairs(record, engine.tokenizer):
            assert 1 <= len(answer) <= TINY["answer_tokens"] and prompt[-1] != EOS
        users = [m["content"] for m in record["messages"] if m["role"] == "user"]
        assert all(degenerate(u) is None and bench_overlap(u) < BENCH_OVERLAP for u in users)
    assert progress.tokens["user"] > 0 and progress.tokens["answer"] > 0


def test_greedy_answers_are_the_targets_own_greedy_continuations(engine, tmp_path):
    generate_data(engine, SelfGenSettings(samples=16, **TINY), tmp_path, model_name="tiny", progress_bar=False)
    greedy = [r for r in lines(tmp_path) if r["mode"] == "greedy"]
    assert greedy
    for record in greedy:
        prompt, answer = training_pairs(record, engine.tokenizer)[0]
        alone = engine.model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=TINY["answer_tokens"],
                                      eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
        assert answer == alone[: len(answer)] and (answer[-1] == EOS or len(answer) == TINY["answer_tokens"])


def test_a_stopped_run_resumes_to_the_data_of_one_uninterrupted_run(engine, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    generate_data(engine, SelfGenSettings(samples=14, **TINY), whole, model_name="tiny", progress_bar=False)
    generate_data(engine, SelfGenSettings(samples=6, **TINY), parts, model_name="tiny", progress_bar=False)
    # a chunk written after the last commit (the process killed before progress.json) is dropped
    shard = sorted(parts.glob("data-*.jsonl"))[-1]
    with open(shard, "a") as f:
        f.write(json.dumps({"index": 999, "torn": True}) + "\n{\"ind")
    generate_data(engine, SelfGenSettings(samples=14, **TINY), parts, model_name="tiny", progress_bar=False)
    assert lines(parts) == lines(whole)
    assert json.loads((parts / "progress.json").read_text())["dropped"] == \
        json.loads((whole / "progress.json").read_text())["dropped"]


def test_a_directory_made_with_other_settings_is_not_resumed(engine, tmp_path):
    generate_data(engine, SelfGenSettings(samples=4, **TINY), tmp_path, model_name="tiny", progress_bar=False)
    with pytest.raises(ValueError, match="answer_tokens"):
        generate_data(engine, SelfGenSettings(samples=8, **{**TINY, "answer_tokens": 11}), tmp_path,
                      model_name="tiny", progress_bar=False)


@pytest.mark.parametrize("bad", [dict(), dict(samples=0), dict(samples=4, hours=0.0), dict(samples=4, batch=0),
                                 dict(samples=4, sampled_share=1.5), dict(samples=4, dtype="float16"),
                                 dict(samples=4, user_temperature=0.0)])
def test_settings_refuse_what_cannot_run(bad):
    with pytest.raises(ValueError):
        SelfGenSettings(**bad)


# ---- held out by construction -----------------------------------------------------------------------
def every_bench_prompt() -> list[str]:
    """Every prompt text the benchmark's own functions build for a chat model."""
    from hasten.bench import spec_bench, structured
    from hasten.bench.chat_tasks import PROMPTS
    from hasten.bench.gec_tasks import gec_tasks

    texts = [m["content"] for conversations in PROMPTS.values() for messages in conversations for m in messages]
    for line in spec_bench.QUESTIONS.read_text().splitlines():
        texts.extend(json.loads(line)["turns"])
    texts.extend(structured.INSTRUCTIONS.values())
    texts.extend(task.prompt for task in gec_tasks(tiny_tokenizer(), per_task=200))
    return texts


def test_the_guard_knows_every_bench_prompt():
    prompts = every_bench_prompt()
    assert len(prompts) >= 480 + 80  # Spec-Bench's first turns and MT-bench's second ones at least
    assert len(bench_texts()) >= 480
    missed = [p for p in prompts if len(p.strip()) >= 16 and bench_overlap(p) < 1.0]
    assert not missed, missed[:3]


def test_the_guard_drops_bench_prompts_inside_or_reworded_and_keeps_other_text():
    question = json.loads(__import__("hasten.bench.spec_bench", fromlist=["QUESTIONS"]).QUESTIONS
                          .read_text().splitlines()[0])["turns"][0]
    assert bench_overlap(f"Hello! I have a request for you. {question} Thanks a lot.") >= BENCH_OVERLAP
    assert bench_overlap(question.replace("engaging", "fun").upper()) >= BENCH_OVERLAP
    for text in ("How do I keep basil alive on a windowsill in winter?",
                 "Write a limerick about a cat who learns to play the trombone badly."):
        assert bench_overlap(text) < BENCH_OVERLAP


def test_generated_prompts_share_no_ngrams_with_the_bench(engine, tmp_path):
    """The overlap check on generated data, able to fail: a bench prompt planted among the
    generated ones is found."""
    generate_data(engine, SelfGenSettings(samples=16, **TINY), tmp_path, model_name="tiny", progress_bar=False)
    generated = [m["content"] for r in lines(tmp_path) for m in r["messages"] if m["role"] == "user"]
    bench = NgramIndex(5)
    for prompt in every_bench_prompt():
        bench.add(prompt)

    def overlapping(prompts):
        return [p for p in prompts if bench.overlap(p) >= BENCH_OVERLAP]

    assert generated and not overlapping(generated)
    planted = every_bench_prompt()[123]
    assert overlapping([*generated, planted]) == [planted]


def test_degenerate_text_is_recognised():
    assert degenerate("1234 5678 !!!") == "no letters"
    assert degenerate("Hi there") == "too short"
    assert degenerate("tell me more " * 6) == "repeated n-grams"
    assert degenerate("How do I bake bread without yeast at home?") is None


def test_near_duplicates_are_found_by_jaccard():
    index = NgramIndex(3)
    index.add("How do I bake bread without yeast at home?")
    assert index.jaccard("how do i bake bread without yeast at home") == 1.0
    assert index.jaccard("How do I bake bread without yeast at home, quickly?") > 0.6
    assert index.jaccard("What is the capital of Peru?") == 0.0


# ---- the command --------------------------------------------------------------------------------------
def test_the_command_refuses_a_model_without_a_chat_template(cli, tmp_path):
    status, _, err = cli("train", "data", "--model", "zoo:code-tiny", "--out", str(tmp_path / "d"),
                         "--samples", "2", "--dtype", "float32")
    assert status != 0 and "chat template" in err


# ---- the data kept in the repository ---------------------------------------------------------------
ARCHIVE = Path(__file__).resolve().parents[1] / "data" / "selfgen-smollm2-135m.tar.xz"


@pytest.mark.skipif(not ARCHIVE.is_file(), reason="this tree keeps no self-generated data")
def test_the_kept_data_resumes_under_the_documented_command_and_holds_no_bench_prompt(tmp_path):
    """docs/training.md: unpacked into the cache, the archive is a directory that `hasten train
    data --model zoo:smollm2-135m --out ...` (its default settings) resumes; its records are all
    there, in index order, and none of its user turns is a benchmark prompt."""
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(tmp_path, filter="data")
    out = tmp_path / "smollm2-135m"
    progress = open_progress(out, SelfGenSettings(hours=1).key("zoo:smollm2-135m"))
    records = lines(out)
    assert len(records) == progress.records > 0
    indices = [r["index"] for r in records]
    assert indices == sorted(set(indices)) and indices[-1] < progress.next_index
    bench = NgramIndex(5)
    for prompt in every_bench_prompt():
        bench.add(prompt)
    users = [m["content"] for r in records for m in r["messages"] if m["role"] == "user"]
    assert len(users) >= len(records)
    assert not [u for u in users if bench.overlap(u) >= BENCH_OVERLAP]
