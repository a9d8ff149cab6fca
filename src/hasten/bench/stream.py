"""Benchmarks where requests learn from each other: each method keeps one drafter (and each vLLM
baseline one engine) for the whole workload, so a request may draft from every earlier one's text.

``hasten bench`` times each prompt several times and warms each method up on the first prompt,
which a pooled drafter would remember: here every prompt runs once per method, in the workload's
order, methods interleaved (their order rotated every prompt), after a warm-up on a prompt outside
the workload. Every output is checked against plain decoding (vLLM's are counted, as in ``hasten
bench``).

Workloads, from text hasten's authors did not write:

* ``spec-bench``: a stream of Spec-Bench questions, the first ``--per-task`` of each category in
  Spec-Bench's order, MT-bench's second turns right after the conversation questions (the
  model's own first answers in them);
* ``extraction``: one instruction applied to many passages: MT-bench's named-entity extraction
  instruction (question 137) on the opening sentences of Spec-Bench's summarization articles
  (CNN/DailyMail), ``--count`` of them.

    python -m hasten.bench.stream --model zoo:smollm2-135m --workload spec-bench --per-task 6 \\
        --max-new-tokens 64 --threads 1 --out stream-out
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from datetime import datetime, timezone

import torch

from ..api import AUTOREGRESSIVE, make_drafter
from ..engine.loop import generate
from ..engine.sizing import default_size, sizing_rule
from ..engine.calibration import load_or_calibrate
from .chat_tasks import chat_task, task_input_ids
from .runner import OVERALL, Cell, LosslessnessError, Method, _check, compare
from .spec_bench import QUESTIONS, SOURCE, second_turns, spec_bench_tasks

EXTRACTION_QUESTION = 137  # MT-bench: named entities of a news article as a JSON dictionary
PASSAGE_SENTENCES = 3
WARMUP_QUESTION = 560  # Spec-Bench's last question (RAG): outside every workload here


def _questions() -> dict[int, dict]:
    return {record["question_id"]: record for record in map(json.loads, QUESTIONS.read_text().splitlines())}


def extraction_tasks(tokenizer, count: int) -> list:
    """MT-bench's extraction instruction (question 137, its article left out) on the first
    ``PASSAGE_SENTENCES`` sentences of the first ``count`` Spec-Bench summarization articles."""
    questions = _questions()
    instruction = questions[EXTRACTION_QUESTION]["turns"][0].split("\n\n")[0]
    articles = [q["turns"][0].removeprefix("Summarize: ") for q in questions.values() if q["category"] == "summarization"]
    if not 1 <= count <= len(articles):
        raise ValueError(f"--count must be between 1 and {len(articles)}, got {count}")
    tasks = []
    for index, article in enumerate(articles[:count]):
        sentences = re.split(r"(?<=[.!?])\s+", article.strip())
        passage = " ".join(sentences[:PASSAGE_SENTENCES])
        messages = ({"role": "user", "content": f"{instruction}\n\n{passage}"},)
        tasks.append(chat_task(tokenizer, f"extraction-{index + 1}", "extraction", messages, SOURCE))
    return tasks


def spec_bench_stream(model, tokenizer, per_task: int, max_new_tokens: int) -> list:
    """Spec-Bench's first ``per_task`` questions per category in its order, each MT-bench
    second turn right after the conversation questions (after the model's own greedy answer)."""
    tasks = spec_bench_tasks(tokenizer, per_task)
    ids = {task.name: task_input_ids(tokenizer, task) for task in tasks}

    def answer(task) -> str:
        out = generate(model, ids[task.name], max_new_tokens=max_new_tokens).sequences[0, ids[task.name].shape[1]:]
        return tokenizer.decode(out.tolist(), skip_special_tokens=True).strip()

    conversation = [t for t in tasks if t.category == "conversation"]
    return conversation + second_turns(tokenizer, conversation, answer) + \
        [t for t in tasks if t.category != "conversation"]


def workload_tasks(workload: str, model, tokenizer, per_task: int, count: int, max_new_tokens: int) -> list:
    """The stream a ``--workload`` names, in its order (spec-bench's second turns hold the
    model's own first answers, ``max_new_tokens`` long)."""
    if workload == "spec-bench":
        return spec_bench_stream(model, tokenizer, per_task, max_new_tokens)
    return extraction_tasks(tokenizer, count)


def warmup_task(tokenizer):
    record = _questions()[WARMUP_QUESTION]
    return chat_task(tokenizer, "warm-up", "warm-up", ({"role": "user", "content": record["turns"][0]},), SOURCE)


def kept_method(name: str, model, label: str | None = None, draft_size: str | None = None, **settings) -> Method:
    """A hasten method whose drafter and sizing rule are built once and kept for the whole
    stream (the drafter's pool, if it has one, and the rule's measured acceptance learn from
    every prompt before), as the server keeps them."""
    drafter = make_drafter(name, **settings)
    draft_size = default_size(draft_size, sampled=False, seeded=False)
    rule = sizing_rule(draft_size)
    if draft_size == "auto" and drafter is not None:
        load_or_calibrate(model)

    def run(input_ids, max_new_tokens):
        clock = time.perf_counter()
        out = generate(model, input_ids, drafter=drafter, max_new_tokens=max_new_tokens, eos_token_id=[],
                       draft_size=rule)
        seconds = time.perf_counter() - clock
        return out.sequences[0, input_ids.shape[1]:].tolist(), out.stats, seconds

    return Method(label or name, "hasten", run, settings, None if drafter is None else draft_size)


def run_stream(methods: list[Method], tasks: list, input_ids: list[torch.Tensor], max_new_tokens: int,
               warmup_ids: torch.Tensor, log=lambda *_: None) -> dict:
    """Every method on every task once, in order, interleaved (order rotated per task)."""
    names = [m.name for m in methods]
    if AUTOREGRESSIVE not in names:
        raise ValueError(f"the methods must include {AUTOREGRESSIVE!r}: it is the reference output")
    for method in methods:
        tokens, _, seconds = method.run(warmup_ids, max_new_tokens)
        log("warm-up", method.name, len(tokens), seconds)
    cells = {t.name: {} for t in tasks}
    outputs = {t.name: {} for t in tasks}
    for index, (task, ids) in enumerate(zip(tasks, input_ids)):
        shift = index % len(methods)
        for method in methods[shift:] + methods[:shift]:
            tokens, stats, seconds = method.run(ids, max_new_tokens)
            log(task.name, method.name, len(tokens), seconds)
            cells[task.name][method.name] = Cell([seconds], [stats])
            outputs[task.name][method.name] = tokens
        reference = outputs[task.name][AUTOREGRESSIVE]
        for method in methods:
            if method.exact:
                _check(method.name, task, outputs[task.name][method.name], reference)
            cells[task.name][method.name].identical = outputs[task.name][method.name] == reference
    groups: dict[str, list] = {}
    for task in tasks:
        groups.setdefault(task.category, []).append(task)
    groups[OVERALL] = list(tasks)
    half = len(tasks) // 2  # learning shows as the second half gaining on the first
    groups["first half"], groups["second half"] = list(tasks[:half]), list(tasks[half:])
    return {
        "methods": [{"name": m.name, "kind": m.kind, "settings": m.settings,
                     **({"draft_size": m.draft_size} if m.draft_size else {})} for m in methods],
        "by_task": [{"task": t.name, "category": t.category,
                     "rows": compare({m: [c] for m, c in cells[t.name].items()})} for t in tasks],
        "by_category": {g: compare({m: [cells[t.name][m] for t in group] for m in names})
                        for g, group in groups.items()},
    }


# ---- the command -------------------------------------------------------------------------------
LLAMA_CPP_BACKEND = "llama.cpp"
VLLM_BASELINES = ("vllm", "vllm_ngram", "vllm_suffix", "vllm_hasten_suffix", "vllm_lookahead")
LLAMA_CPP_BASELINE = "llama_cpp"  # llama.cpp's own greedy loop, flash attention on: the backend's reference


def llama_cpp_model(args, tokenizer):
    """The GGUF model on llama.cpp, its context sized to the workload's prompts, answers and warm-up
    (a spec-bench second turn holds its first turn and an answer of at most --max-new-tokens)."""
    from . import llamacpp

    if args.workload == "spec-bench":
        first_turns = spec_bench_tasks(tokenizer, args.per_task)
        room = 2 * args.max_new_tokens + llamacpp.SECOND_TURN_ROOM  # as hasten bench sizes it
    else:
        first_turns, room = extraction_tasks(tokenizer, args.count), 0
    ids = [task_input_ids(tokenizer, t) for t in [*first_turns, warmup_task(tokenizer)]]
    return llamacpp.load(args.model, torch.get_num_threads(), llamacpp.context_for(ids, args.max_new_tokens + room))


HASTEN_METHODS = {  # label -> (registered method, settings)
    "autoregressive": (AUTOREGRESSIVE, {}),
    "prompt_lookup": ("prompt_lookup", {}),
    "lookahead_per_request": ("lookahead", {"shared": False}),
    "lookahead_pooled": ("lookahead", {}),
    "suffix_per_request": ("suffix", {"shared": False}),
    "suffix": ("suffix", {}),
}


def main(argv: list[str] | None = None) -> int:
    from ..arguments import UserError
    from ..loading import gguf_tokenizer, load_model, resolve_path
    from ..machine import machine_info
    from . import llamacpp, vllm_cpu
    from .report import write_report

    parser = argparse.ArgumentParser(prog="python -m hasten.bench.stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", choices=("spec-bench", "extraction"), required=True)
    parser.add_argument("--per-task", type=int, default=6, help="spec-bench: questions per category")
    parser.add_argument("--count", type=int, default=24, help="extraction: passages")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="0: all cores")
    parser.add_argument("--methods", default=",".join(HASTEN_METHODS))
    parser.add_argument("--backend", choices=("torch", LLAMA_CPP_BACKEND), default="torch",
                        help="llama.cpp: --model is a GGUF file (or a zoo name with one) that hasten's methods run "
                             "through llama.cpp, against llama.cpp's own loops")
    parser.add_argument("--baselines", help="comma-separated; none: no baseline. torch backend: vLLM's "
                        f"(hasten.bench.vllm_cpu; default {','.join(VLLM_BASELINES)}); llama.cpp backend: "
                        f"llama.cpp's loops (hasten.bench.llamacpp; default {LLAMA_CPP_BASELINE})")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    on_llama_cpp = args.backend == LLAMA_CPP_BACKEND
    if args.baselines is None:
        args.baselines = LLAMA_CPP_BASELINE if on_llama_cpp else ",".join(VLLM_BASELINES)
    if on_llama_cpp:
        tokenizer = gguf_tokenizer(args.model)
        model = llama_cpp_model(args, tokenizer)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_path(args.model))
        model = load_model(args.model, "float32", "cpu")
    tasks = workload_tasks(args.workload, model, tokenizer, args.per_task, args.count, args.max_new_tokens)
    input_ids = [task_input_ids(tokenizer, t) for t in tasks]
    warmup_ids = task_input_ids(tokenizer, warmup_task(tokenizer))
    labels = [m for m in args.methods.split(",") if m]
    unknown = [m for m in labels if m not in HASTEN_METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; known: {', '.join(HASTEN_METHODS)}")
    methods = [kept_method(HASTEN_METHODS[m][0], model, label=m, **HASTEN_METHODS[m][1]) for m in labels]
    context = max(ids.shape[1] for ids in [*input_ids, warmup_ids]) + args.max_new_tokens + 8
    try:
        for name in [b for b in args.baselines.split(",") if b and b != "none"]:
            methods.append(llamacpp.baseline_method(name, model) if on_llama_cpp
                           else vllm_cpu.baseline_method(name, model, context, args.threads))
    except (UserError, ValueError) as err:
        print(f"stream: {err}", file=sys.stderr)
        return 2
    machine = machine_info()
    print(f"stream: {len(methods)} methods x {len(tasks)} prompts, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, load {machine['load_average']}", file=sys.stderr)

    def log(task, method, tokens, seconds):
        print(f"stream {task} {method}: {tokens} tokens in {seconds:.2f} s", file=sys.stderr, flush=True)

    try:
        measured = run_stream(methods, tasks, input_ids, args.max_new_tokens, warmup_ids, log)
    except LosslessnessError as err:
        print(f"stream: LOSSLESSNESS FAILURE: {err}", file=sys.stderr)
        return 1
    finally:
        for method in methods:
            if method.close:
                method.close()
    results = {
        "command": " ".join(["python -m hasten.bench.stream", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "machine_after": machine_info()["load_average"],
        "settings": {"model": args.model, "workload": args.workload, "per_task": args.per_task, "count": args.count,
                     "max_new_tokens": args.max_new_tokens, "backend": args.backend,
                     "dtype": "the GGUF file's" if on_llama_cpp else "float32", "repeats": 1, "draft": None,
                     "chat_template": True},
        "tasks": [dataclasses.asdict(t) for t in tasks],
        **measured,
    }
    paths = write_report(results, args.out)
    for row in results["by_category"][OVERALL]:
        print(f"{row['method']:>24}  {row['tokens_per_second']:7.1f} tok/s  tau {row['tau']:.2f}  "
              f"{row['speedup_vs_ar'] or 0:.2f}x  identical {row['identical']}")
    print(f"stream: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
