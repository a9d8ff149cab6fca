"""Spec-Bench, the benchmark this field reports on: its 480 questions, vendored unchanged in
``data/spec_bench`` (hemingkx/Spec-Bench, Apache-2.0; see ``SOURCE.md`` there).

Six categories, as Spec-Bench reports them: multi-turn conversation (the 80 MT-bench questions,
8 categories of 10, here ``conversation``), translation, summarization, question answering,
mathematical reasoning and retrieval-augmented generation (80 each). Each task is a question's
first turn through the model's chat template (a plain transcript for a base model);
conversation takes its questions round-robin over MT-bench's 8 categories, so a few of them
already span writing, roleplay, reasoning, math, coding, extraction, STEM and humanities.
MT-bench's questions have a second turn, which Spec-Bench asks after the model's own answer
to the first: :func:`second_turns` builds those tasks once the model has answered (its greedy
first answer, to EOS or the token budget), category ``conversation`` too, named ``...-turn2``.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Callable

from .chat_tasks import chat_task
from .tasks import Task, read_prompts

QUESTIONS = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
SOURCE = "Spec-Bench question.jsonl (hemingkx/Spec-Bench fd2c1cd, Apache-2.0)"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = ("conversation", "translation", "summarization", "qa", "math_reasoning", "rag")
PER_CATEGORY = 80


def spec_bench_tasks(tokenizer, per_task: int) -> list[Task]:
    """The first ``per_task`` questions of each of Spec-Bench's six categories, in its order
    (conversation round-robin over MT-bench's categories)."""
    if not 1 <= per_task <= PER_CATEGORY:
        raise ValueError(f"--per-task must be between 1 and {PER_CATEGORY} for spec-bench, got {per_task}")
    questions = read_prompts(QUESTIONS)  # every first turn, file order
    rank = Counter()
    ordered = []
    for index, question in enumerate(questions):
        if question.category in MT_BENCH:  # round-robin: the i-th question of each MT-bench category, then the next
            key = (CATEGORIES.index("conversation"), rank[question.category], MT_BENCH.index(question.category))
            rank[question.category] += 1
        else:
            key = (CATEGORIES.index(question.category), index, 0)
        ordered.append((key, question))
    ordered.sort(key=lambda pair: pair[0])
    tasks, taken = [], Counter()
    for _, question in ordered:
        category = "conversation" if question.category in MT_BENCH else question.category
        if taken[category] < per_task:
            taken[category] += 1
            messages = ({"role": "user", "content": question.prompt},)
            tasks.append(chat_task(tokenizer, f"spec-bench-{question.name}", category, messages, SOURCE))
    return tasks


def second_turns(tokenizer, tasks: list[Task], answer: Callable[[Task], str]) -> list[Task]:
    """The second turn of every MT-bench task in ``tasks`` (Spec-Bench's conversation
    questions): its first turn, ``answer(task)`` (the model's own answer to it) as the
    assistant's turn, then the question's second turn."""
    turns = {}
    for line in QUESTIONS.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if len(record["turns"]) > 1:
            turns[f"spec-bench-{record['question_id']}"] = record["turns"]
    follow_ups = []
    for task in tasks:
        if task.name in turns and task.messages:
            first, second = turns[task.name][:2]
            messages = ({"role": "user", "content": first}, {"role": "assistant", "content": answer(task)},
                        {"role": "user", "content": second})
            follow_ups.append(chat_task(tokenizer, f"{task.name}-turn2", task.category, messages, SOURCE))
    return follow_ups
