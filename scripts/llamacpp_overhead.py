"""hasten's llama.cpp backend against llama-cpp-python's own greedy loop, prefill and decode apart
(issue 27, item 2; the numbers are in docs/cpu.md).

For the first ``--per-category`` Spec-Bench questions of each category (first turn, chat
template), each repeat runs, in alternating order, (a) llama-cpp-python's ``Llama.generate``
with flash attention (``Llama(..., flash_attn=True, n_batch=512, n_ubatch=512)``, the reference
hasten's backend equals; ``llm.reset()`` first, so every run prefills its prompt), (b) hasten's
``autoregressive`` method and (c) hasten's default method (prompt lookup, auto sizing), both
through ``hasten.load(gguf, backend="llama.cpp")`` and ``Engine.steps`` (detokenising as a user
sees it). Every run stops at ``--new`` tokens or the first end-of-generation token. Times: wall
and process CPU (the CPU time is the steadier one on a shared machine), the prefill up to the
first token apart from the rest, and the CPU time spent inside ``llama_decode`` (at 1 thread
the calling thread computes alone), so that what each loop adds around llama.cpp shows apart
from the machine's noise. Each hasten run's tokens must equal llama.cpp's (it stops otherwise).

    OMP_NUM_THREADS=1 python scripts/llamacpp_overhead.py --per-category 3 --repeats 3 --out runs.json

It prints a table (medians over repeats; per category the ratio of summed times, llama.cpp's
over the method's, so > 1 is faster than llama.cpp; geomean over categories) and writes every
run to ``--out``. ``--summarise a.json b.json ...`` prints the table of runs written before
(their runs pooled, e.g. processes alternated with another checkout on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict

METHODS = ("llama_cpp", "hasten_autoregressive", "hasten_default")


def measure(args) -> list[dict]:
    import torch

    torch.set_num_threads(args.threads)
    import llama_cpp

    import hasten
    from hasten.bench.spec_bench import spec_bench_tasks
    from hasten.core.stats import DecodeStats
    from hasten.zoo import real

    path = args.model or str(real.resolve("smollm2-135m"))
    engines = {"hasten_autoregressive": hasten.load(path, "autoregressive", backend="llama.cpp", threads=args.threads),
               "hasten_default": hasten.load(path, backend="llama.cpp", threads=args.threads)}
    tokenizer = engines["hasten_autoregressive"].tokenizer
    prompts = [(task.category, engines["hasten_autoregressive"].encode_chat(list(task.messages)))
               for task in spec_bench_tasks(tokenizer, args.per_category)]  # [(category, [1, T] ids)]
    llm = llama_cpp.Llama(path, n_ctx=args.context, n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, flash_attn=True, verbose=False)
    end_of_generation = engines["hasten_autoregressive"].runtime.eos_token_ids()

    def llama_cpp_run(ids) -> tuple[list[int], float, float]:
        llm.reset()  # no reuse of the previous run's cache
        tokens, first = [], None
        for token in llm.generate(ids[0].tolist(), temp=0.0, repeat_penalty=1.0):
            if first is None:
                first = time.perf_counter(), time.process_time()
            tokens.append(token)
            if len(tokens) == args.new or token in end_of_generation:
                break
        return tokens, *first

    def hasten_run(engine):
        def run(ids) -> tuple[list[int], float, float]:
            tokens, first = [], None
            for _, new in engine.steps(ids, DecodeStats(), max_new_tokens=args.new):
                if first is None and new:
                    first = time.perf_counter(), time.process_time()
                tokens.extend(new)
            return tokens, *first
        return run

    runners = {"llama_cpp": llama_cpp_run, **{name: hasten_run(engine) for name, engine in engines.items()}}
    # llama_decode's own CPU time (the calling thread's, which computes alone at 1 thread), so
    # that what each loop adds around it can be told apart from the machine's noise
    in_llama_decode = [0.0]
    llama_decode = llama_cpp.llama_cpp.llama_decode

    def timed_llama_decode(ctx, batch):
        clock = time.thread_time()
        try:
            return llama_decode(ctx, batch)
        finally:
            in_llama_decode[0] += time.thread_time() - clock

    llama_cpp.llama_cpp.llama_decode = timed_llama_decode  # both loops call it through this module
    runs = []
    for repeat in range(args.repeats):
        for index, (category, ids) in enumerate(prompts):
            order = list(METHODS) if (repeat + index) % 2 == 0 else list(reversed(METHODS))
            for method in order:
                in_llama_decode[0] = 0.0
                wall, cpu = time.perf_counter(), time.process_time()
                tokens, first_wall, first_cpu = runners[method](ids)
                end_wall, end_cpu = time.perf_counter(), time.process_time()
                runs.append({"label": args.label, "repeat": repeat, "prompt": index, "category": category,
                             "prompt_tokens": ids.shape[1], "method": method, "tokens": len(tokens),
                             "prefill_wall": first_wall - wall, "prefill_cpu": first_cpu - cpu,
                             "decode_wall": end_wall - first_wall, "decode_cpu": end_cpu - first_cpu,
                             "llama_decode_cpu": in_llama_decode[0],
                             "output": tokens})
            outputs = {run["method"]: run["output"] for run in runs[-len(METHODS):]}
            reference = outputs["llama_cpp"]
            for method, tokens in outputs.items():
                if tokens != reference:
                    sys.exit(f"{method} wrote other tokens than llama.cpp on prompt {index} ({category})")
    return runs


def summarise(runs: list[dict]) -> None:
    labels = sorted({run["label"] for run in runs})
    cells = defaultdict(list)  # (label, method, prompt) -> runs
    for run in runs:
        cells[run["label"], run["method"], run["prompt"]].append(run)
    categories = defaultdict(set)
    for run in runs:
        categories[run["category"]].add(run["prompt"])

    def median(label, method, prompt, part, key) -> float:
        """Median seconds over repeats; part: prefill, decode or total; key: wall or cpu."""
        return statistics.median(run[f"prefill_{key}"] + run[f"decode_{key}"] if part == "total" else run[f"{part}_{key}"]
                                 for run in cells[label, method, prompt])

    print(f"{'category (prompt tokens)':28}" + "".join(f" | {label}:{method} total (prefill, decode)"
                                                       for label in labels for method in METHODS[1:]))
    for key in ("cpu", "wall"):
        ratios = defaultdict(list)
        print(f"-- {key} time, llama.cpp / method --")
        for category, prompts in categories.items():
            lengths = sorted({run["prompt_tokens"] for run in runs if run["category"] == category})
            line = f"{category} ({'/'.join(map(str, lengths))})"
            line = f"{line:28}"
            for label in labels:
                for method in METHODS[1:]:
                    parts = {}
                    for part in ("total", "prefill", "decode"):
                        ours = sum(median(label, method, p, part, key) for p in prompts)
                        theirs = sum(median(label, "llama_cpp", p, part, key) for p in prompts)
                        parts[part] = theirs / ours
                    ratios[label, method].append(parts["total"])
                    line += f" | {parts['total']:.3f}x ({parts['prefill']:.3f}, {parts['decode']:.3f})"
            print(line)
        line = f"{'geomean':28}"
        for label in labels:
            for method in METHODS[1:]:
                values = ratios[label, method]
                line += f" | {math.exp(sum(map(math.log, values)) / len(values)):.3f}x"
        print(line)
    print("-- CPU time a question outside llama_decode (median ms), and in it (sum over questions, s) --")
    for label in labels:
        for method in METHODS:
            found = [run for run in runs if run["label"] == label and run["method"] == method and "llama_decode_cpu" in run]
            if found:
                outside = statistics.median((run["prefill_cpu"] + run["decode_cpu"] - run["llama_decode_cpu"]) * 1e3
                                            for run in found)
                inside = sum(run["llama_decode_cpu"] for run in found)
                print(f"{label}:{method:24} outside {outside:6.1f} ms   in llama_decode {inside:7.2f} s")
    for label in labels:
        tokens = [run["tokens"] for run in runs if run["label"] == label and run["method"] == "llama_cpp"]
        seconds = [run["decode_wall"] / max(run["tokens"] - 1, 1) for run in runs
                   if run["label"] == label and run["method"] == "llama_cpp"]
        print(f"{label}: llama.cpp wrote {statistics.mean(tokens):.0f} tokens a question on average, "
              f"{1 / statistics.median(seconds):.0f} tok/s decoding (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new", type=int, default=96, help="new tokens at most")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=2048, help="llama-cpp-python's n_ctx")
    parser.add_argument("--model", help="a .gguf file (default: the zoo's smollm2-135m, Q4_1)")
    parser.add_argument("--label", default="hasten", help="names this checkout's runs in the table")
    parser.add_argument("--out", help="write every run here (JSON)")
    parser.add_argument("--summarise", nargs="+", metavar="RUNS", help="print the table of runs written before")
    args = parser.parse_args()
    if args.summarise:
        runs = [run for name in args.summarise for run in json.load(open(name))["runs"]]
    else:
        started = os.getloadavg()
        runs = measure(args)
        if args.out:
            with open(args.out, "w") as file:
                json.dump({"load_average": [started, os.getloadavg()], "runs": runs}, file)
        print(f"load average {started[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    summarise(runs)


if __name__ == "__main__":
    main()
