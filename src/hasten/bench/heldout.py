"""What every built-in benchmark prompt is made of: the Task record, the held-out stdlib
functions (parsed once), deterministic picks, and token counts with the model's tokenizer.
Shared by tasks.py (the default categories) and long_tasks.py (the long-context ones).
"""
from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

from ..zoo.corpus import heldout_files, read_text, stdlib_root

HEAD_LINES = 3  # lines of the function the prompt starts with (signature and a little body)
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
    # needle tasks: the text the continuation must start with, and its token ids (the
    # prompt's own continuation, token for token); the runner records ``needle_hit``
    expected: str = ""
    expected_ids: tuple[int, ...] = ()
    # gec tasks: generation ends at the model's end-of-sequence token (or --max-new-tokens),
    # where every other task ignores it and always writes --max-new-tokens tokens
    stop_at_eos: bool = False


@dataclass(frozen=True)
class Function:
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


def functions(root: Path | None = None) -> tuple[Function, ...]:
    """Every function of a suitable size in the held-out files, in file and line order."""
    return _parsefunctions(stdlib_root() if root is None else Path(root))


@functools.lru_cache(maxsize=4)  # parsing the held-out files takes a second or so
def _parsefunctions(root: Path) -> tuple[Function, ...]:
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
                    found.append(Function(path.relative_to(root).as_posix(), node.name, tuple(body), tuple(lines[:start])))
    # ast.walk is breadth-first; sort by position so the order is plain reading order.
    found.sort(key=lambda f: (f.file, len(f.before)))
    return tuple(found)


def spread(items: list, count: int, offset: int, stride: int) -> list:
    """``count`` items spread over the whole list; different offsets give disjoint picks."""
    slots = count * stride
    return [items[(j * stride + offset) * len(items) // slots] for j in range(count)] if items else []


def token_count(tokenizer, text: str) -> int:
    return len(tokenizer(text, verbose=False).input_ids)  # as the runner encodes prompts, special tokens included


def tail(lines: tuple[str, ...], tokenizer, budget: int) -> str:
    """The fewest whole trailing lines holding at least ``budget`` tokens (all lines if fewer)."""
    start, estimate = len(lines), 0
    while start > 0:
        start -= 1
        estimate += token_count(tokenizer, lines[start])  # per-line counts, summed, roughly the total
        if estimate >= budget and token_count(tokenizer, "".join(lines[start:])) >= budget:
            break
    return "".join(lines[start:])

