"""Benchmark prompts: built from held-out stdlib code, or read from a JSONL file.

The built-in categories follow Spec-Bench's idea that speed-ups depend on the task:
``complete`` (plain continuation), ``copy`` (the answer restates an earlier snippet, as in
retrieval-augmented generation), ``edit`` (the answer is an earlier block with a small
change) and ``long`` (a long context before a continuation). Everything is deterministic:
the held-out files are a fixed hash split of the stdlib, and functions are picked at fixed
positions in that list, so the same settings always give the same prompts.
"""
from __future__ import annotations

import ast
import builtins
import functools
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..zoo.corpus import heldout_files, read_text, stdlib_root

CATEGORIES = ("complete", "copy", "edit", "long")
HEAD_LINES = 3  # lines of the function the prompt starts with (signature and a little body)
COMPLETE_CONTEXT_TOKENS = 256  # file context before the function for ``complete``
LONG_CONTEXT_TOKENS = 2048  # at least this much context for ``long``
MIN_CHARS, MAX_CHARS = 600, 3000  # function sizes that give a continuation of ~128 tokens or more


@dataclass(frozen=True)
class Task:
    name: str  # unique, e.g. "copy-1" or a Spec-Bench question_id
    category: str
    prompt: str
    source: str = ""  # where the text came from, for the report
    prompt_tokens: int = 0  # measured with the model's tokenizer
    # chat tasks: the conversation the model's chat template formats; ``prompt`` is then the
    # templated text, kept for the report (see chat_tasks.py)
    messages: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class _Function:
    file: str  # relative to the stdlib root
    name: str
    lines: tuple[str, ...]  # the function's source lines, with their indentation and newlines
    before: tuple[str, ...]  # the file's lines before the function

    @property
    def text(self) -> str:
        return "".join(self.lines)

    @property
    def head(self) -> str:
        return "".join(self.lines[:HEAD_LINES])


def _functions(root: Path | None = None) -> tuple[_Function, ...]:
    """Every function of a suitable size in the held-out files, in file and line order."""
    return _parse_functions(stdlib_root() if root is None else Path(root))


@functools.lru_cache(maxsize=4)  # parsing the held-out files takes a second or so
def _parse_functions(root: Path) -> tuple[_Function, ...]:
    found = []
    for path in heldout_files(root):
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:  # e.g. files written for another Python version
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = node.lineno - 1
                if node.decorator_list:  # keep decorators with their function
                    start = node.decorator_list[0].lineno - 1
                body = lines[start : node.end_lineno]
                if MIN_CHARS <= len("".join(body)) <= MAX_CHARS:
                    found.append(_Function(path.relative_to(root).as_posix(), node.name, tuple(body), tuple(lines[:start])))
    # ast.walk is breadth-first; sort by position so the order is plain reading order.
    found.sort(key=lambda f: (f.file, len(f.before)))
    return tuple(found)


def _spread(items: list, count: int, offset: int, stride: int) -> list:
    """``count`` items spread over the whole list; different offsets give disjoint picks."""
    slots = count * stride
    return [items[(j * stride + offset) * len(items) // slots] for j in range(count)] if items else []


def _token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text).input_ids)  # as the runner encodes prompts, special tokens included


def _tail(lines: tuple[str, ...], tokenizer, budget: int) -> str:
    """The fewest whole trailing lines holding at least ``budget`` tokens (all lines if fewer)."""
    start, estimate = len(lines), 0
    while start > 0:
        start -= 1
        estimate += _token_count(tokenizer, lines[start])  # per-line counts, summed, roughly the total
        if estimate >= budget and _token_count(tokenizer, "".join(lines[start:])) >= budget:
            break
    return "".join(lines[start:])


def _rename_target(function: _Function) -> tuple[str, str]:
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


def _build(category: str, function: _Function, other: _Function, tokenizer) -> str:
    if category == "complete":
        return _tail(function.before, tokenizer, COMPLETE_CONTEXT_TOKENS) + function.head
    if category == "long":
        return _tail(function.before, tokenizer, LONG_CONTEXT_TOKENS) + function.head
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
    """``per_task`` prompts for each category, lengths measured with ``tokenizer``."""
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"unknown task categories {unknown}; known: {', '.join(CATEGORIES)}")
    if per_task < 1:
        raise ValueError(f"--per-task must be >= 1, got {per_task}")
    functions = _functions(root)
    # ``long`` needs a function deep enough in its file: code is ~3-4 characters a token, and
    # twice that leaves room for tokenizers with shorter tokens.
    deep = [f for f in functions if sum(map(len, f.before)) >= 8 * LONG_CONTEXT_TOKENS]
    tasks = []
    for index, category in enumerate(CATEGORIES):  # fixed offsets: a category's picks never depend on the others
        if category not in categories:
            continue
        pool = deep if category == "long" else functions
        picks = _spread(pool, per_task, index, len(CATEGORIES))
        if len(picks) < per_task:
            raise ValueError(f"no held-out functions to build {category!r} tasks from")
        for j, function in enumerate(picks):
            other = functions[(functions.index(function) + len(functions) // 2) % len(functions)]
            prompt = _build(category, function, other, tokenizer)
            source = f"{function.file}:{len(function.before) + 1} {function.name}"
            tasks.append(Task(f"{category}-{j + 1}", category, prompt, source, _token_count(tokenizer, prompt)))
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
        count = _token_count(tokenizer, prompt) if tokenizer is not None else 0
        tasks.append(Task(name, category, prompt, where, count))
    if not tasks:
        raise ValueError(f"--prompts: no prompts in {path}")
    names = Counter(t.name for t in tasks)
    duplicated = [n for n, k in names.items() if k > 1]
    if duplicated:
        raise ValueError(f"--prompts: duplicate question_id {duplicated[0]!r} in {path}")
    return tasks
