"""Training data a chat model writes itself: its own user turns, then its own answers.

``generate_data(engine, settings, out_dir)`` makes samples in index order. Sample ``i``:

1. :func:`~hasten.training.selfprompt.plan` draws, from ``i`` and ``settings.seed`` only, what
   steers it (a system prompt naming a kind of user, a task and a topic, or none), whether its
   answers are greedy or sampled, and whether it gets a follow-up turn;
2. the model writes the user turn from the chat template's opened user header, sampled, until
   its end-of-turn token; the turn is dropped when it is unfinished, degenerate
   (:func:`~hasten.training.textcheck.degenerate`), a near-duplicate of an earlier sample's
   (word 3-gram Jaccard), or overlaps any benchmark prompt (word 5-grams,
   :func:`~hasten.training.textcheck.bench_overlap`);
3. the model answers it (greedy, or sampled with its seed), and for a follow-up writes a second
   user turn after its answer (checked the same way, duplicates aside) and answers that too.

Every generation runs in hasten's batch (:class:`~hasten.engine.batch.Scheduler`: one target
forward per step for all rows, each row exactly as it would be alone, sampled rows with their
own seeds), a chunk of samples at a time. A chunk's records are appended to a JSONL shard and
then ``progress.json`` is replaced atomically: that file is the commit point. A run that is
stopped (killed, out of time) and started again truncates the shards to what ``progress.json``
records, rebuilds the duplicate index from them and goes on at the next index, so it loses at
most one chunk and writes what one uninterrupted run writes.

A record (one line) holds the conversation and the model's own answer tokens::

    {"index": 12, "seed": 1748960230, "mode": "greedy" | "sampled", "topic": "...",
     "messages": [{"role": "system"?...}, {"role": "user", ...}, {"role": "assistant", ...}, ...],
     "answers": [[token ids of the first answer], [of the second]], "finish": ["stop", "length"]}

The assistant messages are the answers decoded; :func:`training_pairs` gives each answer with
the ids of the prompt it answered (the chat template over the messages before it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from ..core.settings import Settings, option
from .selfprompt import Plan, plan
from .textcheck import NgramIndex, bench_overlap, degenerate

PROGRESS = "progress.json"
SHARD_RECORDS = 2000  # records per shard file
DUPLICATE_NGRAM, DUPLICATE_JACCARD = 3, 0.6  # a user turn this similar to an earlier one is a duplicate
BENCH_OVERLAP = 0.5  # a user turn sharing this share of its (or a bench prompt's) 5-grams is dropped
_MARK = "\x00hasten-user-turn\x00"
# fields that do not change what is written: a run may be resumed with other values
_RUN_ONLY = ("samples", "hours")


@dataclass(frozen=True)
class SelfGenSettings(Settings):
    samples: int | None = option(None, "stop after this many sample indices (kept or dropped); unset: --hours")
    hours: float | None = option(None, "stop starting new chunks after this many hours of this run")
    seed: int = option(0, "with a sample's index, seeds everything about it")
    batch: int = option(16, "rows decoded together (one target forward per step for all of them)")
    chunk: int = option(32, "samples made and written together: what an interruption can lose")
    user_tokens: int = option(128, "most tokens of a user turn the model writes (a longer one is dropped)")
    answer_tokens: int = option(256, "most tokens of an answer (a longer one is cut and kept)")
    user_temperature: float = option(0.8, "temperature the user turns are sampled with")
    user_top_p: float = option(0.95, "top-p the user turns are sampled with")
    answer_temperature: float = option(0.8, "temperature of the sampled answers")
    sampled_share: float = option(0.5, "share of samples whose answers are sampled (the rest greedy)")
    followup_share: float = option(0.3, "share of samples with a second user turn the model writes after its answer")
    dtype: str = option("bfloat16", "the target's dtype: bfloat16 (hasten's fastest path on a CPU) or float32")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.samples is None and self.hours is None:
            raise ValueError("set samples or hours (or both): when to stop")
        if self.samples is not None and self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.hours is not None and self.hours <= 0:
            raise ValueError(f"hours must be > 0, got {self.hours}")
        for name in ("batch", "chunk", "user_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("user_temperature", "answer_temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("user_top_p", "sampled_share", "followup_share"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)}")
        if self.user_top_p == 0:
            raise ValueError("user_top_p must be > 0")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dtype must be bfloat16 or float32, got {self.dtype!r}")

    def key(self, model: str) -> dict:
        """What decides the data: a run resumes only a directory made with the same key."""
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in _RUN_ONLY}
        return {"model": model, **fields}


# ---- the state on disk ---------------------------------------------------------------------------
@dataclass
class Progress:
    key: dict
    next_index: int = 0
    records: int = 0
    shards: dict = dataclasses.field(default_factory=dict)  # name -> [bytes, records]
    dropped: dict = dataclasses.field(default_factory=dict)  # reason -> samples
    tokens: dict = dataclasses.field(default_factory=lambda: {"user": 0, "answer": 0})
    seconds: float = 0.0  # generation wall time over every run (pauses included)

    def save(self, out_dir: Path) -> None:
        temporary = out_dir / (PROGRESS + ".tmp")
        temporary.write_text(json.dumps(dataclasses.asdict(self), indent=1) + "\n")
        os.replace(temporary, out_dir / PROGRESS)


def open_progress(out_dir: Path, key: dict) -> Progress:
    """The committed progress of ``out_dir`` (shards truncated to it), or a fresh start."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / PROGRESS
    if not path.is_file():
        if any(out_dir.glob("data-*.jsonl")):
            raise ValueError(f"{out_dir} holds data shards but no {PROGRESS}: not a directory this command wrote")
        return Progress(key)
    progress = Progress(**json.loads(path.read_text()))
    if progress.key != key:
        changed = sorted(k for k in set(key) | set(progress.key) if key.get(k) != progress.key.get(k))
        raise ValueError(f"{out_dir} was made with other settings ({', '.join(changed)}); "
                         "use another --out or the same settings")
    for shard in out_dir.glob("data-*.jsonl"):
        if shard.name not in progress.shards:
            shard.unlink()  # begun by a chunk that never committed
    for name, (size, _) in progress.shards.items():
        with open(out_dir / name, "r+b") as f:
            f.truncate(size)  # drop a chunk written after the last commit
    return progress


def read_records(out_dir: str | Path) -> Iterator[dict]:
    """Every committed record, in index order."""
    out_dir = Path(out_dir)
    progress = json.loads((out_dir / PROGRESS).read_text())
    for name in sorted(progress["shards"]):
        size = progress["shards"][name][0]
        with open(out_dir / name, "rb") as f:
            for line in f.read(size).splitlines():
                yield json.loads(line)


def training_pairs(record: dict, tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) for each answer of a record: the chat template over the
    messages before that answer, with the assistant's turn opened."""
    pairs, seen = [], 0
    for k, message in enumerate(record["messages"]):
        if message["role"] == "assistant":
            prompt = tokenizer.apply_chat_template(record["messages"][:k], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"]
            pairs.append((list(prompt), record["answers"][seen]))
            seen += 1
    return pairs


# ---- making samples ----------------------------------------------------------------------------
class Writer:
    """Runs the generations of a chunk in one batch per phase, on an engine's runtime."""

    def __init__(self, engine, settings: SelfGenSettings):
        from ..engine.batch import Scheduler

        self.engine, self.settings, self.tokenizer = engine, settings, engine.tokenizer
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("self-generated data needs a chat model: this tokenizer has no chat template")
        self.scheduler = Scheduler(engine.runtime, None, max_batch=settings.batch)
        self.tokens = Counter()

    def user_header(self, messages: list[dict]) -> list[int]:
        """The template over ``messages`` and an opened user turn (no end-of-turn after it)."""
        text = self.tokenizer.apply_chat_template([*messages, {"role": "user", "content": _MARK}], tokenize=False)
        return self.tokenizer(text[: text.index(_MARK)], add_special_tokens=False).input_ids

    def prompt(self, messages: list[dict]) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])

    def run(self, jobs: list[tuple[list[int], int, float, int | None]], kind: str) -> list[tuple[list[int], str]]:
        """Each job (input ids, max new tokens, temperature (0: greedy), seed) -> (tokens, finish reason)."""
        from ..core.threads import using_threads

        top_p = self.settings.user_top_p if kind == "user" else None
        rows = {}
        for number, (ids, budget, temperature, seed) in enumerate(jobs):
            request = self.engine.request(ids, max_new_tokens=budget, temperature=temperature, top_p=top_p,
                                          seed=seed if temperature > 0 else None)
            rows[self.scheduler.submit(request)] = number
        with using_threads(self.engine.threads):
            results = self.scheduler.run()
        out: list = [None] * len(jobs)
        for row_id, result in results.items():
            out[rows[row_id]] = (result.tokens, result.finish_reason)
            self.tokens[kind] += len(result.tokens)
        return out

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()


def _system(content: str | None) -> list[dict]:
    return [] if content is None else [{"role": "system", "content": content}]


def make_chunk(writer: Writer, plans: list[Plan], duplicates: NgramIndex, dropped: Counter) -> list[dict]:
    """The records of one chunk of samples, in index order (``duplicates`` learns their user turns)."""
    s = writer.settings

    def user_turns(contexts: list[list[dict]], seeds: list[int]) -> list[tuple[str | None, str | None]]:
        """(text, None) or (None, why it was dropped) for each context."""
        jobs = [(writer.user_header(c), s.user_tokens, s.user_temperature, seed) for c, seed in zip(contexts, seeds)]
        turns = []
        for tokens, reason in writer.run(jobs, "user"):
            text = writer.text(tokens)
            why = "unfinished" if reason != "stop" else degenerate(text)
            if why is None and bench_overlap(text) >= BENCH_OVERLAP:
                why = "overlaps a benchmark prompt"
            turns.append((None, why) if why else (text, None))
        return turns

    def answer(conversations: list[list[dict]], items: list[Plan], offset: int) -> list[tuple[list[int], str]]:
        jobs = [(writer.prompt(c), s.answer_tokens, s.answer_temperature if p.sampled else 0.0, p.seed + offset)
                for c, p in zip(conversations, items)]
        return writer.run(jobs, "answer")

    records: dict[int, dict] = {}
    firsts = user_turns([_system(p.writer_system) for p in plans], [p.seed for p in plans])
    kept = []
    for p, (text, why) in zip(plans, firsts):  # in index order, so duplicates are judged as one run would
        if why is None and duplicates.jaccard(text) >= DUPLICATE_JACCARD:
            why = "duplicate"
        if why is not None:
            dropped[why] += 1
            continue
        duplicates.add(text)
        kept.append(p)
        records[p.index] = {"index": p.index, "seed": p.seed, "mode": "sampled" if p.sampled else "greedy",
                            "topic": p.topic, "messages": [*_system(p.answer_system), {"role": "user", "content": text}],
                            "answers": [], "finish": []}

    def add_answers(items: list[Plan], offset: int) -> None:
        for p, (tokens, reason) in zip(items, answer([records[p.index]["messages"] for p in items], items, offset)):
            record = records[p.index]
            record["messages"].append({"role": "assistant", "content": writer.text(tokens)})
            record["answers"].append(tokens)
            record["finish"].append(reason)

    add_answers(kept, 1)
    followers = [p for p in kept if p.followup and records[p.index]["finish"][0] == "stop"]
    if followers:
        seconds = user_turns([records[p.index]["messages"] for p in followers], [p.seed + 2 for p in followers])
        asked = []
        for p, (text, why) in zip(followers, seconds):
            if why is not None:
                dropped[f"follow-up {why}"] += 1
                continue
            records[p.index]["messages"].append({"role": "user", "content": text})
            asked.append(p)
        add_answers(asked, 3)
    return [records[i] for i in sorted(records)]


def generate_data(engine, settings: SelfGenSettings, out_dir: str | Path, *, model_name: str,
                  progress_bar: bool = True) -> Progress:
    """Make (or, where ``out_dir`` holds a run's progress, go on with) self-generated data until
    ``settings.samples`` indices are done or ``settings.hours`` have passed; returns the
    progress committed last."""
    out_dir = Path(out_dir)
    progress = open_progress(out_dir, settings.key(model_name))
    duplicates = NgramIndex(DUPLICATE_NGRAM)
    for record in read_records(out_dir) if progress.records else ():
        duplicates.add(next(m["content"] for m in record["messages"] if m["role"] == "user"))
    writer = Writer(engine, settings)
    began = time.monotonic()
    deadline = None if settings.hours is None else began + settings.hours * 3600
    bar = tqdm(total=settings.samples, initial=progress.next_index, unit="sample", desc="selfgen",
               disable=not progress_bar, file=sys.stderr, mininterval=10, dynamic_ncols=True)
    done_here = 0
    while settings.samples is None or progress.next_index < settings.samples:
        if deadline is not None and time.monotonic() >= deadline:
            break
        start = progress.next_index
        stop = start + settings.chunk if settings.samples is None else min(start + settings.chunk, settings.samples)
        clock = time.monotonic()
        dropped = Counter(progress.dropped)
        writer.tokens = Counter()
        records = make_chunk(writer, [plan(settings.seed, i, settings.sampled_share, settings.followup_share)
                                      for i in range(start, stop)], duplicates, dropped)
        _append(out_dir, progress, records)
        progress.next_index, progress.dropped = stop, dict(dropped)
        for kind, count in writer.tokens.items():
            progress.tokens[kind] = progress.tokens.get(kind, 0) + count
        progress.seconds = round(progress.seconds + time.monotonic() - clock, 1)
        progress.save(out_dir)  # the commit point
        done_here += stop - start
        if deadline is not None and settings.samples is None:  # the total this run will reach, at this pace
            pace = done_here / (time.monotonic() - began)
            bar.total = int(stop + pace * max(0.0, deadline - time.monotonic()))
        bar.set_postfix(kept=progress.records, tok_s=round(sum(progress.tokens.values()) / max(progress.seconds, 1e-9), 1),
                        refresh=False)
        bar.update(stop - start)
    bar.close()
    return progress


def _append(out_dir: Path, progress: Progress, records: list[dict]) -> None:
    """Append a chunk's records to the current shard (a new one every SHARD_RECORDS records),
    flushed to disk before the progress that counts them is written."""
    for record in records:
        name = max(progress.shards, default=None)
        if name is None or progress.shards[name][1] >= SHARD_RECORDS:
            name = f"data-{len(progress.shards):05d}.jsonl"
            progress.shards[name] = [0, 0]
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        with open(out_dir / name, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        progress.shards[name][0] += len(line)
        progress.shards[name][1] += 1
        progress.records += 1
