"""The stream bench's report (hasten.bench.stream): groups that are no task's category (the
stream's two halves) say how many prompts they hold. No model: methods that return fixed tokens."""
from __future__ import annotations

import dataclasses

from hasten.bench.report import markdown
from hasten.bench.runner import AUTOREGRESSIVE, Method
from hasten.bench.stream import run_stream
from hasten.bench.tasks import Task
from hasten.core.stats import DecodeStats


def fixed_method(name: str, tokens_per_step: int) -> Method:
    """Four tokens a prompt, ``tokens_per_step`` a target forward, 0.1 s a forward."""
    def run(input_ids, max_new_tokens):
        steps = 4 // tokens_per_step
        stats = DecodeStats(steps=steps, new_tokens=4, prefill_seconds=0.01, verify_seconds=0.1 * steps)
        return [1, 2, 3, 4], stats, 0.01 + 0.1 * steps

    return Method(name, "hasten", run)


def test_the_stream_halves_count_their_prompts():
    tasks = [Task(f"extraction-{i}", "extraction", "-", source="test", prompt_tokens=8) for i in range(1, 6)]
    methods = [fixed_method(AUTOREGRESSIVE, 1), fixed_method("suffix", 2)]
    measured = run_stream(methods, tasks, [None] * len(tasks), max_new_tokens=4, warmup_ids=None)
    results = {
        "command": "python -m hasten.bench.stream", "date": "2026-01-01",
        "settings": {"model": "tiny", "draft": None, "max_new_tokens": 4, "repeats": 1},
        "machine": {"cpu": "cpu", "cores": 1, "torch_threads": 1, "gpu": None, "python": "3", "torch": "2",
                    "transformers": "5", "hasten": "0"},
        "tasks": [dataclasses.asdict(t) for t in tasks],
        **measured,
    }
    md = markdown(results)
    for heading in ("## extraction (5 prompts)", "## overall (5 prompts)", "## first half (2 prompts)",
                    "## second half (3 prompts)"):
        assert heading in md
