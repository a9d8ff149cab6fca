"""EasySpec against draft_model, and the cost model of layer-parallel drafting.

    python -m hasten.bench.easyspec --model zoo:code-tiny --draft zoo:code-tiny-draft4

Two parts, one process, one machine:

1. **Generation** (greedy, interleaved: every repeat runs every configuration on every
   prompt in turn): autoregressive, draft_model and easyspec in each grouping and
   concurrency mode. Per configuration: tau, drafting seconds per step, wall time and the
   speedup over autoregressive; outputs are checked token-identical to autoregressive.
2. **Cost model**: the draft's one-token pass taken apart (embedding E, attention A_l and
   MLP M_l of each layer, head H: CPU-time medians, each piece timed inside whole passes,
   after the median-length prompt), then the drafting stage predicted for k devices:
   draft_model spends ``T_exact(b) + (n - 1) * T_exact(1) + o`` per step and easyspec
   ``T_exact(b') + (n - 1) * T_fuzzy(k) + o``, where

       T_exact(1) = E + sum_l (A_l + M_l) + H
       T_fuzzy(k) = E + sum_groups (max_device sum_{members on it} A_l + s) + sum_l M_l + H

   with groups of min(k, layers) consecutive layers, members dealt to devices in turn, and
   ``s`` the cost of handing a group out and collecting it (0 for ideal devices; measured
   for CPU threads). ``b`` and ``b'`` are the first forward's block lengths (draft_model
   feeds the tokens its cache lacks, easyspec every token committed since the last exact
   pass; both measured) and ``o`` the host work of a step outside the passes, fitted once on
   draft_model's measured CPU time. Every configuration run here is predicted beside what
   it measured, and one-token passes of each grouping and mode are timed by the wall clock,
   interleaved (the only real concurrency a CPU machine has: threads).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..loading import load_model, load_tokenizer
from ..core.stats import DecodeStats
from ..drafters import DraftModel, EasySpec, EasySpecSettings
from ..drafters.base import Drafter
from ..drafters.draft_model import _common_prefix
from ..engine.loop import generate
from ..machine import machine_info
from ..models import cache as kv
from .tasks import builtin_tasks


def configurations(layers: int, num_tokens: int) -> dict[str, dict | None]:
    """label -> easyspec settings (None: draft_model); every group size that groups anything."""
    sizes = [g for g in (2, 4, 8) if g <= layers] or [layers]
    out: dict[str, dict | None] = {"draft_model": None}
    for g in sizes:
        for mode in ("serial", "threads"):
            out[f"easyspec g={g} {mode}"] = dict(num_tokens=num_tokens, group_size=g, concurrency=mode)
    out[f"easyspec g={sizes[-1]} serial parallel_mlp"] = dict(num_tokens=num_tokens, group_size=sizes[-1],
                                                              parallel_mlp=True)
    if layers >= 4:  # first and last layer exact, the middle ones one group
        middle = ",".join(map(str, range(1, layers - 1)))
        out[f"easyspec groups=0;{middle};{layers - 1} serial"] = dict(
            num_tokens=num_tokens, groups=f"0;{middle};{layers - 1}")
    return out


class FirstBlock(Drafter):
    """Wraps draft_model or easyspec and records each proposal's first block length: the
    tokens its draft cache lacks (easyspec: its calibration block, the root included)."""

    name = "first_block"

    def __init__(self, inner: DraftModel):
        self.inner, self.lengths = inner, []
        self.cpu_seconds = 0.0  # the calling thread's CPU time in propose (threads' workers not counted)

    def check_target(self, target):
        self.inner.check_target(target)

    def begin(self, ctx):
        return self.inner.begin(ctx)

    def propose(self, ctx):
        state = ctx.state
        if isinstance(self.inner, EasySpec):
            cached = state.exact
        else:  # draft_model keeps the accepted part of its last proposal
            cached = state.committed + _common_prefix(state.drafted, ctx.tokens, state.committed, len(ctx.tokens) - 1)
        self.lengths.append(len(ctx.tokens) - cached)
        start = time.thread_time()
        draft = self.inner.propose(ctx)
        self.cpu_seconds += time.thread_time() - start
        return draft

    def observe(self, ctx, result):
        self.inner.observe(ctx, result)


def run_generations(target, draft, prompts, configs, num_tokens, max_new_tokens, repeats):
    drafters: dict[str, Drafter | None] = {"autoregressive": None}
    for label, settings in configs.items():
        inner = DraftModel(draft, num_tokens=num_tokens) if settings is None else EasySpec(draft, **settings)
        drafters[label] = FirstBlock(inner)
    stats = {label: DecodeStats() for label in drafters}
    walls: dict[str, list[float]] = {label: [] for label in drafters}
    references = {}
    for _ in range(repeats):
        for index, ids in enumerate(prompts):
            for label, drafter in drafters.items():
                start = time.perf_counter()
                out = generate(target, ids, drafter=drafter, max_new_tokens=max_new_tokens, eos_token_id=[],
                               threads=None)
                walls[label].append(time.perf_counter() - start)
                stats[label] += out.stats
                tokens = out.sequences[0].tolist()
                if references.setdefault(index, tokens) != tokens:
                    raise RuntimeError(f"{label} changed the greedy output of prompt {index}")
    base = sum(walls["autoregressive"])
    rows = {}
    for label, s in stats.items():
        rows[label] = {"tau": round(s.mean_accepted, 3),
                       "draft_ms_per_step": round(1e3 * s.draft_seconds / s.steps, 3) if s.steps else None,
                       "verify_ms_per_step": round(1e3 * s.verify_seconds / s.steps, 3) if s.steps else None,
                       "wall_s": round(sum(walls[label]), 3), "speedup": round(base / sum(walls[label]), 3)}
        drafter = drafters[label]
        if isinstance(drafter, FirstBlock):
            rows[label]["first_block_mean"] = round(statistics.mean(drafter.lengths), 3)
            rows[label]["draft_cpu_ms_per_step"] = round(1e3 * drafter.cpu_seconds / s.steps, 3)
    return rows


def _median_seconds(fn, reps: int, clock=time.thread_time) -> float:
    """Median over ``reps`` runs. The default clock is this thread's CPU time, so other
    processes on a shared machine do not inflate it (for single-threaded work it is the
    wall time an idle machine would show)."""
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


@torch.no_grad()
def layer_times(draft, context: list[int], reps: int) -> dict:
    """Median CPU seconds of the pieces of a one-token exact pass after ``context`` (see the
    module doc), each timed inside whole passes (a piece timed alone runs with its weights
    hot in the CPU caches and looks up to twice as fast), of whole exact passes over 1..4
    tokens, and the median wall seconds of a thread hand-off."""
    driver = EasySpec(draft, group_size=1).driver
    cache = kv.new_cache(False)
    driver.forward(cache, context, exact=True)
    length, token, clock = kv.length(cache), [context[-1]], time.thread_time
    layers = len(driver.layers)
    pieces = {"embed": [], "head": [], "attention": [[] for _ in range(layers)], "mlp": [[] for _ in range(layers)]}
    for _ in range(reps):
        kv.crop(cache, length)
        mark = clock()
        hidden, inputs = driver.start(cache, token)
        pieces["embed"].append(clock() - mark)
        for index in range(layers):
            mark = clock()
            hidden = hidden + driver.member_update(index, hidden, inputs)
            pieces["attention"][index].append(clock() - mark)
            mark = clock()
            hidden = hidden + driver.feed_forward(index, hidden)
            pieces["mlp"][index].append(clock() - mark)
        mark = clock()
        driver.logits(hidden)
        pieces["head"].append(clock() - mark)
    out = {"context_tokens": length,
           **{name: ([statistics.median(x) for x in runs] if name in ("attention", "mlp") else statistics.median(runs))
              for name, runs in pieces.items()}}
    for block in (1, 2, 3, 4):
        def whole(block=block):
            kv.crop(cache, length)
            driver.forward(cache, token * block, exact=True)
        out[f"exact_pass_{block}"] = _median_seconds(whole, reps)
    threaded = EasySpec(draft, group_size=2, concurrency="threads").driver
    # waiting is not CPU time: a hand-off is timed by the wall clock
    out["thread_handoff"] = _median_seconds(lambda: threaded.pool.submit(int).result(), reps, time.perf_counter)
    kv.crop(cache, length)
    return out


@torch.no_grad()
def pass_walls(draft, context: list[int], reps: int) -> dict:
    """Median wall seconds of one one-token pass after ``context`` for each grouping and
    concurrency mode, the modes interleaved round by round so that load from other
    processes falls on all of them alike: the only real concurrency this machine has."""
    layers = draft.config.num_hidden_layers
    modes = {"exact": dict(group_size=1)}
    for g in [g for g in (2, 4) if g <= layers]:
        modes[f"g={g} serial"] = dict(group_size=g)
        modes[f"g={g} threads"] = dict(group_size=g, concurrency="threads")
    drivers = {label: EasySpec(draft, **settings).driver for label, settings in modes.items()}
    cache = kv.new_cache(False)
    drivers["exact"].forward(cache, context, exact=True)
    length, token = kv.length(cache), [context[-1]]
    walls: dict[str, list[float]] = {label: [] for label in drivers}
    for _ in range(reps):
        for label, driver in drivers.items():
            kv.crop(cache, length)
            start = time.perf_counter()
            driver.forward(cache, token, exact=label == "exact")
            walls[label].append(time.perf_counter() - start)
    kv.crop(cache, length)
    return {label: statistics.median(times) for label, times in walls.items()}


def fuzzy_pass_seconds(times: dict, groups, devices: int, sync: float, parallel_mlp: bool = False) -> float:
    """T_fuzzy for layer ``groups``, each group's members dealt to ``devices`` in turn."""
    attention, mlp = times["attention"], times["mlp"]
    total = times["embed"] + times["head"]
    for members in groups:
        together = parallel_mlp and len(members) > 1  # the MLPs are branches too
        branch = [attention[i] + (mlp[i] if together else 0.0) for i in members]
        total += max(sum(branch[j::devices]) for j in range(min(devices, len(branch))))
        total += sync if len(branch) > 1 and devices > 1 else 0.0
        total += 0.0 if together else sum(mlp[i] for i in members)
    return total


def exact_block_seconds(times: dict, block: float) -> float:
    """T_exact for a block of ``block`` tokens, interpolated between the measured 1..4."""
    low = max(1, min(4, int(block)))
    high = min(4, low + 1)
    frac = min(max(block - low, 0.0), 1.0)
    return (1 - frac) * times[f"exact_pass_{low}"] + frac * times[f"exact_pass_{high}"]


def cost_model(times: dict, walls: dict, rows: dict, configs: dict, num_tokens: int,
               device_counts=(2, 4, 8)) -> dict:
    """Predicted drafting seconds per step, and the drafting speedup over draft_model, for
    k ideal devices; then every configuration run on this machine (serial: one device;
    threads: two cores and a measured hand-off), beside what it measured. Every easyspec
    prediction uses the calibration block its own configuration measured."""
    layers = len(times["attention"])
    sequential = times["embed"] + sum(times["attention"]) + sum(times["mlp"]) + times["head"]
    passes = (exact_block_seconds(times, rows["draft_model"]["first_block_mean"])
              + (num_tokens - 1) * sequential)
    # the host work of a step outside the passes (sampling, bookkeeping, Hugging Face's own
    # forward glue), fitted once on draft_model's measured CPU time and used unchanged below
    overhead = max(rows["draft_model"]["draft_cpu_ms_per_step"] / 1e3 - passes, 0.0)
    draft_model_step = passes + overhead

    def step(label: str, devices: int, sync: float) -> tuple[float, float]:
        settings = EasySpecSettings(**configs[label])
        calibration = exact_block_seconds(times, rows[label]["first_block_mean"])
        fuzzy = fuzzy_pass_seconds(times, settings.layer_groups(layers), devices, sync, settings.parallel_mlp)
        return fuzzy, calibration + (num_tokens - 1) * fuzzy + overhead

    out = {"sequential_pass_ms": round(1e3 * sequential, 4), "step_overhead_ms": round(1e3 * overhead, 4),
           "draft_model_step_ms": {"predicted": round(1e3 * draft_model_step, 4),
                                   "measured": rows["draft_model"]["draft_ms_per_step"],
                                   "measured_cpu": rows["draft_model"]["draft_cpu_ms_per_step"]},
           "ideal_devices": {}, "this_machine": {}, "one_pass_ms": {}}
    for label, wall in walls.items():
        if label == "exact":
            predicted = sequential
        else:
            group = int(label.split()[0][2:])
            threads = label.endswith("threads")
            predicted = fuzzy_pass_seconds(times, EasySpecSettings(group_size=group).layer_groups(layers),
                                           2 if threads else 1, times["thread_handoff"] if threads else 0.0)
        out["one_pass_ms"][label] = {"predicted": round(1e3 * predicted, 4), "measured_wall": round(1e3 * wall, 4)}
    run_sizes = [g for g in (2, 4, 8) if f"easyspec g={g} serial" in configs]
    for k in device_counts:
        group = max(g for g in run_sizes if g <= max(k, run_sizes[0]))  # k devices serve groups of up to k
        fuzzy, total = step(f"easyspec g={group} serial", k, 0.0)
        out["ideal_devices"][k] = {"group_size": group, "fuzzy_pass_ms": round(1e3 * fuzzy, 4),
                                   "easyspec_step_ms": round(1e3 * total, 4),
                                   "drafting_speedup": round(draft_model_step / total, 3)}
    for label, row in rows.items():
        if label not in configs or configs[label] is None:
            continue
        threads = configs[label].get("concurrency") == "threads"
        _, total = step(label, 2 if threads else 1, times["thread_handoff"] if threads else 0.0)
        out["this_machine"][label] = {"predicted_step_ms": round(1e3 * total, 4),
                                      "measured_step_ms": row["draft_ms_per_step"],
                                      "measured_cpu_step_ms": row["draft_cpu_ms_per_step"],
                                      "predicted_drafting_speedup": round(draft_model_step / total, 3)}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hasten.bench.easyspec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="zoo:code-tiny")
    p.add_argument("--draft", default="zoo:code-tiny-draft4")
    p.add_argument("--num-tokens", type=int, default=5)
    p.add_argument("--per-task", type=int, default=2, help="prompts per category (complete, copy, edit)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--reps", type=int, default=300, help="runs per timed piece of the cost model")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--out", type=Path, help="write the JSON report here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    target, draft = load_model(args.model), load_model(args.draft)
    tokenizer = load_tokenizer(args.model)
    tasks = builtin_tasks(tokenizer, ("complete", "copy", "edit"), per_task=args.per_task)
    prompts = [tokenizer(t.prompt, return_tensors="pt").input_ids for t in tasks]
    configs = configurations(draft.config.num_hidden_layers, args.num_tokens)
    rows = run_generations(target, draft, prompts, configs, args.num_tokens, args.max_new_tokens, args.repeats)
    context = sorted((ids[0].tolist() for ids in prompts), key=len)[len(prompts) // 2]  # the median length
    times = layer_times(draft, context, args.reps)
    walls = pass_walls(draft, context, args.reps)
    report = {"command": " ".join(["python -m hasten.bench.easyspec", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "model": args.model, "draft": args.draft,
              "num_tokens": args.num_tokens, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "generation": rows,
              "layer_times_ms": {k: ([round(1e3 * x, 4) for x in v] if isinstance(v, list) else
                                     (v if k == "context_tokens" else round(1e3 * v, 4))) for k, v in times.items()},
              "one_pass_wall_ms": {k: round(1e3 * v, 4) for k, v in walls.items()},
              "cost_model": cost_model(times, walls, rows, configs, args.num_tokens)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
