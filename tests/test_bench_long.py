"""hasten bench's long-context tasks (long4k, long16k, needle) and the KV bytes it reports.

Task builders run on zoo:code-tiny's real tokenizer (only the tokenizer is loaded); the
runs use tiny random models. Nothing here asserts a timing.
"""
import json
import warnings

import pytest
import torch
from transformers import AutoTokenizer

import hasten
from hasten.api import AUTOREGRESSIVE
from hasten.loading import resolve_path
from hasten.bench.long_tasks import LONG_PREFIX_TOKENS, NEEDLE_DISTANCE_TOKENS, NEEDLE_LINES
from hasten.bench.report import markdown
from hasten.bench.runner import OVERALL, check_lengths, hasten_method, hf_method, run_bench
from hasten.bench.tasks import CATEGORIES, LONG_CATEGORIES, Task, builtin_tasks
from hasten.core.stats import DecodeStats
from hasten.drafters.draft_model import DraftModel
from hasten.drafters.eagle import Eagle
from hasten.drafters.prompt_lookup import PromptLookup
from hasten.drafters.triforce import TriForce
from hasten.zoo.corpus import read_text, stdlib_root

from helpers import repetitive_prompt, tiny_model

BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # tiny llama: layers x (keys, values) x KV heads x head_dim x float32


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_path("zoo:code-tiny"))


def count(tokenizer, text: str) -> int:
    return len(tokenizer(text, verbose=False).input_ids)


# ---- tasks --------------------------------------------------------------------------------------
def test_long_categories_are_not_in_the_default_set(tokenizer):
    assert not set(LONG_CATEGORIES) & set(CATEGORIES)
    assert {t.category for t in builtin_tasks(tokenizer, per_task=1)} == set(CATEGORIES)
    with pytest.raises(ValueError, match="unknown task categories"):
        builtin_tasks(tokenizer, ["long8k"])


def test_long_prefixes_are_exactly_their_token_count_of_a_held_out_file(tokenizer):
    tasks = builtin_tasks(tokenizer, ["long4k", "long16k"], per_task=2)
    assert [t.name for t in tasks] == ["long4k-1", "long4k-2", "long16k-1", "long16k-2"]
    assert builtin_tasks(tokenizer, ["long16k"], per_task=2) == tasks[2:]  # deterministic, category by category
    for task in tasks:
        wanted = LONG_PREFIX_TOKENS[task.category]
        assert task.prompt_tokens == count(tokenizer, task.prompt) == wanted
        text = read_text(stdlib_root() / task.source.split(":")[0])
        assert text.startswith(task.prompt) and count(tokenizer, text) > wanted  # the file goes on after it
    assert len({t.prompt for t in tasks}) == len(tasks)


def test_needle_is_far_back_and_the_prompt_ends_where_it_is_restated(tokenizer):
    tasks = builtin_tasks(tokenizer, ["needle"], per_task=3)
    assert [t.name for t in tasks] == ["needle-1", "needle-2", "needle-3"]
    for task in tasks:
        assert task.prompt_tokens == count(tokenizer, task.prompt)
        needle, prompt = task.expected, task.prompt
        assert prompt.count(needle) == 1  # copied from far back: nowhere else in the prompt
        at = prompt.index(needle)
        assert count(tokenizer, prompt[at:]) >= NEEDLE_DISTANCE_TOKENS
        head = prompt.rsplit("\n", 1)[1]  # the prompt ends with the function's def line, restated
        assert head.lstrip().startswith(("def ", "async def ")) and prompt[:at].endswith(head)
        assert len([line for line in needle.split("\n") if line.strip()]) == NEEDLE_LINES
        # the needle really follows that def line in the file, and its tokens continue the prompt's
        file, line = task.source.split()[0].rsplit(":", 1)
        lines = read_text(stdlib_root() / file).splitlines(keepends=True)
        assert lines[int(line) - 1].rstrip("\n") == head
        assert "".join(lines[int(line) - 1:]).startswith(head + needle)
        prompt_ids = tokenizer(prompt, verbose=False).input_ids
        assert tokenizer(prompt + needle, verbose=False).input_ids == prompt_ids + list(task.expected_ids)


def test_a_prompt_longer_than_the_model_is_a_clear_error():
    model = tiny_model("llama")  # 512 positions
    task = Task("long4k-1", "long4k", "-", prompt_tokens=4096)
    with pytest.raises(ValueError, match=r"'long4k-1': the prompt has 4096 tokens.*needs a model with more positions"):
        check_lengths(model, [task], [torch.zeros(1, 4096, dtype=torch.long)], max_new_tokens=8)
    with pytest.raises(ValueError, match="fewer --max-new-tokens"):  # the prompt fits, the new tokens do not
        check_lengths(model, [task], [torch.zeros(1, 500, dtype=torch.long)], max_new_tokens=16)


# ---- needle_hit in the runner and the report ---------------------------------------------------
def test_runner_records_needle_hits_and_the_report_shows_them():
    model = tiny_model("llama")
    prompt = repetitive_prompt(24)
    reference = hasten.generate(model, prompt, max_new_tokens=8, eos_token_id=[]).sequences[0, 24:].tolist()
    wrong = [(t + 1) % 96 for t in reference[:3]]
    tasks = [Task("needle-1", "needle", "-", expected="x", expected_ids=tuple(reference[:3])),
             Task("needle-2", "needle", "-", expected="y", expected_ids=tuple(wrong)),
             Task("complete-1", "complete", "-")]
    methods = [hasten_method(AUTOREGRESSIVE, model), hasten_method("prompt_lookup", model), hf_method("hf_generate", model)]
    measured = run_bench(methods, tasks, [prompt] * 3, max_new_tokens=8, repeats=1, progress=False)
    assert [t.get("needle_hit") for t in measured["by_task"]] == [True, False, None]
    rows = {r["method"]: r for r in measured["by_category"][OVERALL]}
    expected_kv = BYTES_PER_TOKEN * (24 + 8 - 1)  # every token but the last is cached
    assert rows[AUTOREGRESSIVE]["target_kv_bytes"] == rows["prompt_lookup"]["target_kv_bytes"] == expected_kv
    assert rows[AUTOREGRESSIVE]["drafter_kv_bytes"] is None and rows["prompt_lookup"]["drafter_kv_bytes"] is None
    assert rows["hf_generate"]["target_kv_bytes"] is None  # not measured
    results = {
        "command": "hasten bench", "date": "2026-01-01", "settings": {"model": "tiny", "draft": None,
                                                                      "max_new_tokens": 8, "repeats": 1},
        "machine": {"cpu": "cpu", "cores": 1, "torch_threads": 1, "gpu": None, "python": "3", "torch": "2",
                    "transformers": "5", "hasten": "0"},
        "tasks": [{"name": t.name, "category": t.category, "prompt_tokens": 24, "source": "test"} for t in tasks],
        **measured,
    }
    md = markdown(json.loads(json.dumps(results)))  # as written to results.json
    assert "Needle accuracy: 1/2 prompts" in md
    assert "| needle-1 | needle | 24 | yes | test |" in md and "| complete-1 | complete | 24 | - | test |" in md
    line = next(row for row in md.splitlines() if row.startswith(f"| {AUTOREGRESSIVE} |"))
    assert f"| {expected_kv / 1e6:.1f} | - |" in line  # target KV MB, drafter KV MB


# ---- KV bytes ---------------------------------------------------------------------------------------
def test_plain_decoding_kv_bytes_grow_with_the_context():
    model = tiny_model("llama")
    sizes = []
    for length in (16, 64, 200):
        out = hasten.generate(model, repetitive_prompt(length), max_new_tokens=6, eos_token_id=[])
        assert out.stats.drafter_kv_bytes is None  # no drafter
        sizes.append(out.stats.target_kv_bytes)
    assert sizes == [BYTES_PER_TOKEN * (length + 6 - 1) for length in (16, 64, 200)]


def test_drafters_with_caches_report_their_bytes():
    model, small = tiny_model("llama"), tiny_model("llama", seed=1)
    prompt = repetitive_prompt(200)
    target_bytes = BYTES_PER_TOKEN * (200 + 12 - 1)

    def run(drafter):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an untrained EAGLE layer says so
            stats = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=12, eos_token_id=[]).stats
        assert stats.target_kv_bytes >= target_bytes  # at least every committed token (plus rejected scratch)
        return stats.drafter_kv_bytes

    assert run(PromptLookup()) is None  # keeps no cache, has no cache_bytes
    assert run(DraftModel(small, num_tokens=3)) >= BYTES_PER_TOKEN * 199  # the draft caches the prompt at least
    # TriForce: a 32-entry retrieval cache and a 4 + 16 token streaming window, far below the full cache
    triforce = run(TriForce(small, budget=32, chunk_size=8, gamma=4, small_gamma=2, sinks=4, window=16))
    assert 0 < triforce < target_bytes // 2
    eagle = Eagle(depth=2, top_k=2, total_tokens=4)
    assert run(eagle) > 0


def test_kv_peaks_add_up_as_the_largest():
    a, b = DecodeStats(steps=1, target_kv_bytes=10), DecodeStats(steps=2, target_kv_bytes=30, drafter_kv_bytes=5)
    total = a + b
    assert (total.steps, total.target_kv_bytes, total.drafter_kv_bytes) == (3, 30, 5)
    assert (DecodeStats() + DecodeStats()).target_kv_bytes is None
    assert total.to_dict()["target_kv_bytes"] == 30


# ---- the CLI ----------------------------------------------------------------------------------------
def test_cli_bench_runs_needle_tasks_by_name_and_refuses_short_models(tmp_path, capsys):
    from hasten.cli import main
    from helpers import tiny_tokenizer

    short, medium, long = tmp_path / "short", tmp_path / "medium", tmp_path / "long"
    for path, positions in ((short, 512), (medium, 4096), (long, 8192)):
        tiny_model("llama", max_position_embeddings=positions).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
    common = ["--per-task", "1", "--repeats", "1", "--max-new-tokens", "4", "--threads", "1", "--no-progress",
              "--methods", AUTOREGRESSIVE, "--baselines", "none"]
    assert main(["bench", "--model", str(short), "--tasks", "needle", "--out", str(tmp_path / "a"), *common]) != 0
    assert "needs a model with more positions" in capsys.readouterr().err
    assert main(["bench", "--model", str(long), "--tasks", "needle", "--out", str(tmp_path / "b"), *common]) == 0
    results = json.loads((tmp_path / "b" / "results.json").read_text())
    assert [(t["task"], type(t["needle_hit"])) for t in results["by_task"]] == [("needle-1", bool)]
    assert results["by_category"][OVERALL][0]["target_kv_bytes"] > 0
    # the default set stays within 4,096 positions: no long task unless named
    assert main(["bench", "--model", str(medium), "--out", str(tmp_path / "c"), *common]) == 0
    assert {t["category"] for t in json.loads((tmp_path / "c" / "results.json").read_text())["tasks"]} == set(CATEGORIES)
