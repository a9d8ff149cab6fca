"""Lossy KV and prompt compression (hasten.approx) against full-cache greedy output.

    python -m hasten.bench.compression [--model zoo:code-tiny] [--draft zoo:code-tiny-draft]
        [--budgets 128,256,512] [--prompts 4] [--length 1500] [--new 48] [--needles 4]

With ``--draft`` as SpecKV's and SpecPC's draft, per policy and budget: on held-out stdlib
files cut to ``--length`` tokens, the prefix agreement (share of the new tokens before the
first one that differs from full-cache greedy output), the agreement (share of equal
positions) and the speed (full-cache time over compressed time, end to end, interleaved
per prompt); on ``--needles`` needle prompts (``hasten bench``'s ``needle`` task: a function
defined 2k+ tokens back, restated at the end), the needle accuracy (share whose
continuation copies the function's next lines exactly). StreamingLLM and SnapKV are the
baselines. Prints a Markdown table, full cache first. Every compressed row is LOSSY.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..approx import SnapKV, SpecKV, SpecPC, StreamingLLM
from ..engine.loop import generate
from .runner import needle_hit
from .tasks import Task

# name -> (budget, draft) -> (a KV compression policy or None, a prompt shortener or None)
POLICIES: dict[str, Callable] = {
    "StreamingLLM": lambda b, draft: (StreamingLLM(budget=b, window=b - 4), None),
    "SnapKV": lambda b, draft: (SnapKV(budget=b, window=32), None),
    "SpecKV": lambda b, draft: (SpecKV(draft=draft, budget=b), None),  # the reference's defaults
    # the reference's window of 64, at most half of a small budget
    "SpecPC": lambda b, draft: (None, SpecPC(draft, budget=b, window=min(64, b // 2))),
}
FULL = "full cache (exact)"


@dataclass
class Row:
    policy: str
    budget: int | None  # None: the full cache
    prefix_agreement: float
    agreement: float
    needle_accuracy: float | None  # None: no needle prompts
    speed: float | None  # full-cache seconds over compressed seconds; None for the full cache
    lossy: bool

    def markdown(self) -> str:
        needle = "-" if self.needle_accuracy is None else f"{self.needle_accuracy:.2f}"
        speed = "-" if self.speed is None else f"{self.speed:.2f}x"
        name = f"{self.policy} (LOSSY)" if self.lossy else self.policy
        return (f"| {name} | {self.budget or '-'} | {self.prefix_agreement:.2f} | {self.agreement:.2f} | "
                f"{needle} | {speed} |")


HEADER = ("| policy | budget | prefix agreement | agreement | needle accuracy | speed |\n"
          "| --- | ---: | ---: | ---: | ---: | ---: |")


def _run(model, prompt: torch.Tensor, new: int, policy=None, shortener=None) -> tuple[list[int], float]:
    clock = time.perf_counter()
    ids = shortener.compress(prompt) if shortener else prompt
    out = generate(model, ids, max_new_tokens=new, eos_token_id=[], kv_compression=policy, threads=None)
    return out.sequences[0, ids.shape[1]:].tolist(), time.perf_counter() - clock


def _needle_accuracy(model, needles: list[tuple[Task, torch.Tensor]], policy=None, shortener=None) -> float | None:
    if not needles:
        return None
    hits = [needle_hit(task, _run(model, ids, len(task.expected_ids), policy, shortener)[0]) for task, ids in needles]
    return sum(hits) / len(hits)


def measure(model, draft, prompts: list[torch.Tensor], needles: list[tuple[Task, torch.Tensor]],
            budgets: list[int], new: int, policies: dict[str, Callable] = POLICIES,
            report: Callable[[Row], None] = lambda row: None) -> list[Row]:
    """The table's rows: the full cache, then every policy at every budget (``report`` sees
    each row as it is done). ``prompts``: [1, T] agreement and speed prompts; ``needles``:
    needle tasks with their [1, T] input ids."""
    full = [_run(model, p, new)[0] for p in prompts]
    rows = [Row(FULL, None, 1.0, 1.0, _needle_accuracy(model, needles), None, False)]
    report(rows[0])
    for budget in budgets:
        for name, make in policies.items():
            prefix, agree, plain_s, compressed_s = [], [], 0.0, 0.0
            for prompt, reference in zip(prompts, full):
                plain_s += _run(model, prompt, new)[1]  # interleaved with the compressed run: drift hits both
                got, seconds = _run(model, prompt, new, *make(budget, draft))
                compressed_s += seconds
                agree.append(sum(a == b for a, b in zip(got, reference)) / new)
                prefix.append(next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), new) / new)
            needle = _needle_accuracy(model, needles, *make(budget, draft))
            speed = plain_s / compressed_s if prompts else None
            rows.append(Row(name, budget, statistics.mean(prefix) if prefix else 0.0,
                            statistics.mean(agree) if agree else 0.0, needle, speed, True))
            report(rows[-1])
    return rows


def main(argv: list[str] | None = None) -> None:
    from ..api import load
    from ..zoo import corpus
    from .tasks import builtin_tasks

    parser = argparse.ArgumentParser(prog="python -m hasten.bench.compression", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="zoo:code-tiny")
    parser.add_argument("--draft", default="zoo:code-tiny-draft", help="SpecKV's and SpecPC's draft model")
    parser.add_argument("--budgets", default="128,256,512")
    parser.add_argument("--prompts", type=int, default=4, help="agreement and speed prompts")
    parser.add_argument("--length", type=int, default=1500, help="prompt tokens")
    parser.add_argument("--new", type=int, default=48, help="new tokens per generation")
    parser.add_argument("--needles", type=int, default=4, help="needle prompts (0: no needle accuracy)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load(args.model, "autoregressive", threads=None)  # torch's threads: --threads, set above
    draft = load(args.draft, "autoregressive", threads=None).model
    texts = [corpus.read_text(f) for f in corpus.heldout_files()]
    prompts = [ids[: args.length] for ids in (engine.tokenizer(t, verbose=False).input_ids for t in texts)
               if len(ids) >= args.length]
    prompts = [torch.tensor([ids]) for ids in prompts[: args.prompts]]
    tasks = builtin_tasks(engine.tokenizer, ["needle"], per_task=args.needles) if args.needles else []
    needles = [(t, torch.tensor([engine.tokenizer(t.prompt, verbose=False).input_ids])) for t in tasks]
    print(f"{args.model}: every row but the first is LOSSY (decodes from a compressed cache or prompt); "
          f"{len(prompts)} prompts of {args.length} tokens, {len(needles)} needle prompts "
          f"({', '.join(str(t.prompt_tokens) for t in tasks)} tokens)\n")
    print(HEADER, flush=True)
    budgets = [int(b) for b in args.budgets.split(",")]
    measure(engine.model, draft, prompts, needles, budgets, args.new, report=lambda row: print(row.markdown(), flush=True))


if __name__ == "__main__":
    main()
