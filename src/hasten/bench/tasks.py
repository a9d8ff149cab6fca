"""Benchmark prompts: built from held-out stdlib code, or read from a JSONL file.

The built-in categories follow Spec-Bench's idea that speed-ups depend on the task:
``complete`` (plain continuation), ``copy`` (the answer restates an earlier snippet, as in
retrieval-augmented generation), ``edit`` (the answer is an earlier block with a small
change) and ``long`` (a long context before a continuation). The long-context categories
(``long4k``, ``long16k``, ``needle``: see long_tasks.py) are built here too but are not in
the default set, ``CATEGORIES``: they need a model with more than 4,096 positions and take
minutes; ask for them by name. Everything is deterministic:
the held-out files are a fixed hash split of the stdlib, and functions are picked at fixed
positions in that list, so the same settings always give the same prompts.
"""
from __future__ import annotations

import ast
import builtins
import json
import re
from collections import Counter
from pathlib import Path

from .heldout import Function, Task, spread, tail, token_count
from .heldout import functions as heldout_functions
from .long_tasks import long_prefix_tasks, needle_tasks

CATEGORIES = ("complete", "copy", "edit", "long")  # the default set: fast, fits 4,096 positions
LONG_CATEGORIES = ("long4k", "long16k", "needle")  # only by name (see long_tasks.py)
ALL_CATEGORIES = CATEGORIES + LONG_CATEGORIES
COMPLETE_CONTEXT_TOKENS = 256  # file context before the function for ``complete``
LONG_CONTEXT_TOKENS = 2048  # at least this much context for ``long``


def _rename_target(function: Function) -> tuple[str, str]:
    """The function's most used local name (not self/cls/builtins), and what to rename it to."""
    text = function.text
    tree = ast.parse("if 1:\n" + text if text[0].isspace() else text)  # ``if 1:`` lets a method parse
    names = Counter(
        node.id if isinstance(node, ast.Name) else node.arg
        for node in ast.walk(tree)
        if isinstance(node, (ast.Name, ast.arg))
    )
    skip = {"self", "cls", *dir(builtins)}
    usable = sorted((-n, name) for name, n in names.items() if name not in skip and len(name) >= 3)
    old = usable[0][1] if usable else function.name
    return old, f"new_{old}"


def _build(category: str, function: Function, other: Function, tokenizer) -> str:
    if category == "complete":
        return tail(function.before, tokenizer, COMPLETE_CONTEXT_TOKENS) + function.head
    if category == "long":
        return tail(function.before, tokenizer, LONG_CONTEXT_TOKENS) + function.head
    if category == "copy":  # reference, an unrelated snippet, then the reference restated
        return (
            f"# Reference: {function.name} from {function.file}\n{function.text}\n"
            f"# Another snippet:\n{other.text}\n"
            f"# {function.name} again, exactly as in the reference:\n{function.head}"
        )
    if category == "edit":  # a block, then the same block with one identifier renamed
        old, new = _rename_target(function)
        renamed = re.sub(rf"\b{re.escape(old)}\b", new, function.head)
        return f"# Before:\n{function.text}\n# After renaming {old} to {new}:\n{renamed}"
    raise ValueError(f"unknown task category {category!r}; known: {', '.join(CATEGORIES)}")


def builtin_tasks(tokenizer, categories=CATEGORIES, per_task: int = 2, root: Path | None = None) -> list[Task]:
    """``per_task`` prompts for each category, lengths measured with ``tokenizer``; the
    default categories first, then the long-context ones asked for."""
    unknown = [c for c in categories if c not in ALL_CATEGORIES]
    if unknown:
        raise ValueError(f"unknown task categories {unknown}; known: {', '.join(ALL_CATEGORIES)}")
    if per_task < 1:
        raise ValueError(f"--per-task must be >= 1, got {per_task}")
    functions = heldout_functions(root)
    # ``long`` needs a function deep enough in its file: code is ~3-4 characters a token, and
    # twice that leaves room for tokenizers with shorter tokens.
    deep = [f for f in functions if sum(map(len, f.before)) >= 8 * LONG_CONTEXT_TOKENS]
    tasks = []
    for index, category in enumerate(CATEGORIES):  # fixed offsets: a category's picks never depend on the others
        if category not in categories:
            continue
        pool = deep if category == "long" else functions
        picks = spread(pool, per_task, index, len(CATEGORIES))
        if len(picks) < per_task:
            raise ValueError(f"no held-out functions to build {category!r} tasks from")
        for j, function in enumerate(picks):
            other = functions[(functions.index(function) + len(functions) // 2) % len(functions)]
            prompt = _build(category, function, other, tokenizer)
            source = f"{function.file}:{len(function.before) + 1} {function.name}"
            tasks.append(Task(f"{category}-{j + 1}", category, prompt, source, token_count(tokenizer, prompt)))
    for category in LONG_CATEGORIES:
        if category == "needle" and category in categories:
            tasks += needle_tasks(tokenizer, per_task, root)
        elif category in categories:
            tasks += long_prefix_tasks(tokenizer, category, per_task, root)
    return tasks


def read_prompts(path: str | Path, tokenizer=None, per_task: int | None = None) -> list[Task]:
    """Tasks from a JSONL file: ``{"prompt": str, "category": str?}`` a line, or a Spec-Bench
    ``question.jsonl`` line (``{"question_id", "category", "turns": [str, ...]}``, first turn used).

    ``per_task`` keeps the first K prompts of each category.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"--prompts: {err.strerror}: {path}") from None
    tasks, seen = [], Counter()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if "prompt" in record:
            prompt = record["prompt"]
        elif "turns" in record:
            turns = record["turns"]
            prompt = turns[0] if isinstance(turns, list) and turns else None
        else:
            raise ValueError(f"{where}: expected a 'prompt' (or Spec-Bench 'turns') field")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: the prompt must be a non-empty string")
        category = record.get("category", "custom")
        if not isinstance(category, str) or not category:
            raise ValueError(f"{where}: 'category' must be a non-empty string")
        seen[category] += 1
        if per_task is not None and seen[category] > per_task:
            continue
        name = str(record.get("question_id", f"{category}-{seen[category]}"))
        count = token_count(tokenizer, prompt) if tokenizer is not None else 0
        tasks.append(Task(name, category, prompt, where, count))
    if not tasks:
        raise ValueError(f"--prompts: no prompts in {path}")
    names = Counter(t.name for t in tasks)
    duplicated = [n for n, k in names.items() if k > 1]
    if duplicated:
        raise ValueError(f"--prompts: duplicate question_id {duplicated[0]!r} in {path}")
    return tasks
