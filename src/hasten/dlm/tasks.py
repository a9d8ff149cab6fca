"""The task of ``hasten dlm bench``: complete a held-out function, judged by exact match and by
whether the completed function parses.

A task is one function of a held-out stdlib file. The prompt is the file up to the end of the
function's docstring (or, without one, of its first statement), so the model sees the signature
and what the function is for; the reference is the rest of the function, from the newline that
ends the prompt's last line. The completion is trimmed where the function ends *by indentation*:
at the first line, after the prompt, that is not blank and is indented no deeper than the ``def``
line (a comment at that depth counts as the end too, as a reader would take it). A completion is
*valid* when ``ast.parse`` accepts the function it completes (``def`` line, docstring, completion),
dedented, and it adds at least one statement; it is an *exact match* when it equals the reference
up to trailing whitespace.
"""
from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass

import numpy as np
import torch


def _indent(line: str) -> int:
    return len(line.expandtabs(8)) - len(line.expandtabs(8).lstrip())


def trim_function(head: str, completion: str) -> str:
    """The part of ``completion`` still inside the function ``head`` starts (head: its ``def`` line on).
    A line that began in ``head`` is continued, never cut."""
    def_line = head.lstrip("\r\n").splitlines()[0]
    depth = _indent(def_line)
    at_line_start = head.endswith(("\n", "\r"))
    offset = 0
    for line in completion.splitlines(keepends=True):
        if at_line_start and line.strip() and _indent(line) <= depth:
            return completion[:offset]
        offset += len(line)
        at_line_start = line.endswith(("\n", "\r"))
    return completion


def completes_function(head: str, completion: str) -> bool:
    """Whether ``completion``, trimmed at the function's end, makes the function parse and adds a
    statement to it (blank lines and comments alone do not count)."""
    try:
        tree = ast.parse(textwrap.dedent(head + trim_function(head, completion)))
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the source
        return False
    head_lines = head.count("\n") + 1
    return len(tree.body) == 1 and tree.body[0].end_lineno > head_lines  # a statement ends past the head


def exact_match(head: str, completion: str, reference: str) -> bool:
    """Whether the trimmed completion is the reference, trailing whitespace aside."""
    return trim_function(head, completion).rstrip() == reference.rstrip()


@dataclass(frozen=True)
class FunctionSplit:
    """Character offsets in one source file: the ``def`` line's start, where the prompt ends, where the
    function (as the trimming rule reads it) ends."""

    start: int
    split: int
    end: int


def function_splits(text: str) -> list[FunctionSplit]:
    """Every function of ``text`` with a body left after its docstring (or first statement) and whose
    real continuation, trimmed by the rule, is the whole function and parses."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    line_starts = np.cumsum([0] + [len(line) for line in text.splitlines(keepends=True)]).tolist()
    splits = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        first, second = node.body[0], node.body[1]
        if first.lineno == node.lineno or second.lineno <= first.end_lineno:
            continue  # a one-line def, or statements sharing a line: no clean line to split at
        # The split is the newline ending the docstring's line, not the next line's start: tokenizers
        # such as code-tiny's merge a newline with the next line's indentation into one token.
        start, split = line_starts[node.lineno - 1], line_starts[first.end_lineno] - 1
        if text[split] != "\n":
            continue
        head, rest = text[start:split], text[split:]
        body = trim_function(head, rest)
        end = split + len(body.rstrip())
        function_end = line_starts[node.end_lineno - 1] + node.end_col_offset
        if end >= function_end and completes_function(head, body):
            splits.append(FunctionSplit(start, split, end))
    return splits


def completion_tasks(tokenizer, files, samples: int, prompt_length: int, gen_length: int, seed: int = 0,
                     min_reference: int | None = None, read=None) -> list[dict]:
    """``samples`` functions of ``files`` with ``prompt_length`` tokens of context before the split and a
    reference of ``min_reference`` (default gen_length // 4) to ``gen_length`` tokens, so that
    ``gen_length`` generated tokens can cover the whole function. Each task: file, prompt [1, prompt_length],
    reference tokens [n], head (the function's text in the prompt), reference_text."""
    min_reference = max(1, gen_length // 4) if min_reference is None else min_reference
    candidates = []
    for path in files:
        text = read(path) if read is not None else open(path, encoding="utf-8", errors="replace").read()
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, starts = encoding.input_ids, [start for start, _ in encoding.offset_mapping]
        for function in function_splits(text):
            first = int(np.searchsorted(starts, function.split))  # the reference's first token
            after = int(np.searchsorted(starts, function.end))  # the first token past the function
            if first == len(starts) or starts[first] != function.split:
                continue  # a token straddles the split: the prompt would hold part of the reference
            if first >= prompt_length and min_reference <= after - first <= gen_length:
                candidates.append({"file": getattr(path, "name", str(path)),
                                   "prompt": torch.tensor([ids[first - prompt_length:first]]),
                                   "reference": torch.tensor(ids[first:after]),
                                   "head": text[function.start:function.split],
                                   "reference_text": text[function.split:function.end]})
    if len(candidates) < samples:
        raise ValueError(f"only {len(candidates)} held-out functions have {prompt_length} tokens before them and "
                         f"{min_reference} to {gen_length} tokens of body after the docstring")
    rng = np.random.default_rng(seed)
    return [candidates[i] for i in sorted(rng.choice(len(candidates), samples, replace=False))]
