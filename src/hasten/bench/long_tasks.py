"""Long-context benchmark prompts: ``long4k``, ``long16k`` and ``needle`` (issue 12).

None of them is in the default category set: their prompts need a model with more than
4,096 positions (``zoo:code-tiny-long``), and they take minutes where the default set
takes seconds. Ask for them by name (``--tasks long4k,long16k,needle``).

* ``long4k`` / ``long16k``: a long held-out stdlib file's first 4,096 / 16,000 tokens (16,000,
  not 16,384: a 16k-position model must have room to continue it),
  decoded back to text, exactly that many tokens long as the model's tokenizer encodes
  it; the model continues the file.
* ``needle``: a function defined at least ``NEEDLE_DISTANCE_TOKENS`` tokens before the
  prompt's end, which ends by restating the function's ``def`` line after a comment; the
  continuation should copy the function's next lines (the needle) from far back. The
  task carries the needle's text and token ids; ``needle_hit`` is whether the generated
  tokens start with them (see runner.needle_hit).

Everything is deterministic: fixed held-out files, fixed picks, fixed token counts.
"""
from __future__ import annotations

from pathlib import Path

from ..zoo.corpus import heldout_files, read_text, stdlib_root
from .heldout import Function, Task, functions, spread, tail, token_count

LONG_PREFIX_TOKENS = {"long4k": 4096, "long16k": 16000}  # long16k leaves a 16,384-position model room for 384 new tokens
LONG_CONTINUATION_TOKENS = 512  # a file must go on at least this long after the prefix: a real continuation
NEEDLE_DISTANCE_TOKENS = 2048  # tokens between the needle function's end and the restatement, at least
NEEDLE_LEAD_TOKENS = 256  # file context before the needle function
NEEDLE_LINES = 2  # non-blank lines after the def line that the continuation must copy
NEEDLE_MIN_CHARS = 16  # non-space characters the needle must have (more than a lone quote or bracket)
# Generated codec tables (encodings/cp864.py: one 13k-token dict literal) are data, not code.
SKIPPED_DIRS = ("encodings/",)


def _ids(tokenizer, text: str) -> list[int]:
    # verbose=False: prompts longer than the tokenizer's model_max_length are the point here
    return tokenizer(text, verbose=False).input_ids  # as the runner encodes prompts, special tokens included


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ---- long4k / long16k -----------------------------------------------------------------------------
def exact_prefix(tokenizer, ids: list[int], count: int) -> str | None:
    """Text that encodes to exactly ``count`` tokens: the decoded first ``count`` of ``ids``,
    or, where decoding and re-encoding changes the count (a multi-byte character split at
    the cut, merges that differ from the file's own), the decoded first ``k`` for the
    nearest ``k`` that gives ``count``. None if none is found nearby."""
    k, tried = count, set()
    while k not in tried and 0 < k <= len(ids):  # step by the shortfall: the count moves with k
        tried.add(k)
        text = _decode(tokenizer, ids[:k])
        got = len(_ids(tokenizer, text))
        if got == count:
            return text
        k += count - got
    for k in sorted(range(max(1, min(tried) - 4), min(len(ids), max(tried) + 4) + 1), key=lambda k: abs(k - count)):
        text = _decode(tokenizer, ids[:k])  # the steps oscillated: try every cut around them
        if len(_ids(tokenizer, text)) == count:
            return text
    return None


def _long_files(root: Path) -> list[tuple[Path, str]]:
    files = []
    for path in heldout_files(root):
        relative = path.relative_to(root).as_posix()
        if not relative.startswith(SKIPPED_DIRS):
            files.append((path, relative))
    return files


def long_prefix_tasks(tokenizer, category: str, per_task: int, root: Path | None = None) -> list[Task]:
    """``per_task`` file prefixes of exactly LONG_PREFIX_TOKENS[category] tokens."""
    count = LONG_PREFIX_TOKENS[category]
    root = stdlib_root() if root is None else Path(root)
    eligible = []  # (relative path, text, ids) of files long enough, in path order
    for path, relative in _long_files(root):
        text = read_text(path)
        if len(text) < count:  # no tokenizer packs more than a character a token into code; skip early
            continue
        ids = _ids(tokenizer, text)
        if len(ids) >= count + LONG_CONTINUATION_TOKENS:
            eligible.append((relative, ids))
    if len(eligible) < per_task:
        raise ValueError(f"only {len(eligible)} held-out files hold {count} + {LONG_CONTINUATION_TOKENS} tokens; "
                         f"{category!r} cannot have {per_task} prompts (use --per-task {max(len(eligible), 1)})")
    tasks = []
    for j, (relative, ids) in enumerate(spread(eligible, per_task, 0, 1)):
        prompt = exact_prefix(tokenizer, ids, count)
        if prompt is None:
            raise ValueError(f"{relative}: no cut near token {count} re-encodes to exactly {count} tokens")
        tasks.append(Task(f"{category}-{j + 1}", category, prompt, f"{relative}: first {count} tokens", count))
    return tasks


# ---- needle ---------------------------------------------------------------------------------------
def _leading(lines: list[str], tokenizer, budget: int) -> str | None:
    """The fewest whole leading lines holding at least ``budget`` tokens (None if all of
    them hold fewer)."""
    text = "".join(lines)
    ids = _ids(tokenizer, text)
    if len(ids) < budget:
        return None
    # the decoded first ``budget`` tokens end inside some line: take every line up to its end
    cut = len(_decode(tokenizer, ids[:budget]))
    end = text.find("\n", max(cut - 1, 0))
    taken = text if end < 0 else text[: end + 1]
    while token_count(tokenizer, taken) < budget and len(taken) < len(text):  # a rare re-encoding shortfall
        end = text.find("\n", len(taken))
        taken = text if end < 0 else text[: end + 1]
    return taken if token_count(tokenizer, taken) >= budget else None


def _def_line(function: Function) -> int | None:
    """Index of the function's ``def`` line (after any decorators)."""
    for index, line in enumerate(function.lines):
        if line.lstrip().startswith(("def ", "async def ")):
            return index
    return None


def needle_prompt(function: Function, after: list[str], tokenizer) -> Task | None:
    """The needle task for ``function`` (``after``: its file's lines after it), or None when
    this function cannot make a clean one: too little file after it, a needle that is blank
    or appears twice, or a tokenization where the needle's tokens are not the prompt's
    continuation token for token."""
    at = _def_line(function)
    if at is None:
        return None
    head = function.lines[at].rstrip("\n")
    end, filled = at + 1, 0  # the needle: the lines after the def up to its NEEDLE_LINES-th non-blank one
    while filled < NEEDLE_LINES and end < len(function.lines):
        filled += bool(function.lines[end].strip())
        end += 1
    if filled < NEEDLE_LINES:
        return None
    needle = "\n" + "".join(function.lines[at + 1 : end]).rstrip("\n")
    if len("".join(needle.split())) < NEEDLE_MIN_CHARS or any(line != line.rstrip() for line in needle.split("\n")):
        return None  # blank, or trailing spaces (whose tokens merge with what follows)
    between = _leading(after, tokenizer, NEEDLE_DISTANCE_TOKENS)
    if between is None:
        return None
    body = tail(function.before, tokenizer, NEEDLE_LEAD_TOKENS) + function.text + between
    if not body.endswith("\n"):
        body += "\n"
    if body.count(head) != 1 or body.count(needle) != 1:
        return None  # the needle must be found far back, and only there
    # The prompt ends right after the def line, without its newline: a line's last character
    # and the newline after it are separate pre-tokens, so the needle's tokens follow the
    # prompt's unchanged; checked below, with the file's next line after the needle too.
    prompt = f"{body}# {function.name}, restated exactly as defined above:\n{head}"
    prompt_ids = _ids(tokenizer, prompt)
    full = _ids(tokenizer, prompt + needle)
    following = function.lines[end] if end < len(function.lines) else "\n"
    if full[: len(prompt_ids)] != prompt_ids or _ids(tokenizer, prompt + needle + "\n" + following)[: len(full)] != full:
        return None
    source = f"{function.file}:{len(function.before) + at + 1} {function.name}"
    return Task("", "needle", prompt, source, len(prompt_ids), expected=needle,
                expected_ids=tuple(full[len(prompt_ids):]))


def needle_tasks(tokenizer, per_task: int, root: Path | None = None) -> list[Task]:
    """``per_task`` needle prompts from functions spread over the held-out files; a pick that
    cannot make a clean needle gives way to the next function after it."""
    root = stdlib_root() if root is None else Path(root)
    # Enough file after the function for the distance: code is 3-4 characters a token, twice
    # that leaves room for tokenizers with shorter tokens. (The line lists are read lazily.)
    lines_of: dict[str, list[str]] = {}

    def after(function: Function) -> list[str]:
        if function.file not in lines_of:
            lines_of[function.file] = read_text(root / function.file).splitlines(keepends=True)
        return lines_of[function.file][len(function.before) + len(function.lines):]

    pool = [f for f in functions(root) if not f.file.startswith(SKIPPED_DIRS)]
    pool = [f for f in pool if sum(map(len, after(f))) >= 8 * NEEDLE_DISTANCE_TOKENS]
    tasks, used = [], set()
    for start in (pool.index(f) for f in spread(pool, per_task, 0, 1)):
        for function in pool[start:] + pool[:start]:
            if id(function) in used:
                continue
            used.add(id(function))
            task = needle_prompt(function, after(function), tokenizer)
            if task is not None:
                tasks.append(Task(f"needle-{len(tasks) + 1}", task.category, task.prompt, task.source,
                                  task.prompt_tokens, expected=task.expected, expected_ids=task.expected_ids))
                break
    if len(tasks) < per_task:
        raise ValueError(f"only {len(tasks)} held-out functions make clean needle tasks; use --per-task {len(tasks)}")
    return tasks
