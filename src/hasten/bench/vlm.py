"""``hasten vlm bench``: speculative decoding on a vision-language target (SpecVLM's table).

On held-out generated scenes (zoo:vlm-tiny's world, seeds the training never drew), two tasks:
``caption`` ("Describe the image.": long templated replies) and ``qa`` (one question per
scene: short replies, where the prefill dominates), and ``all`` (both, time-weighted). Methods, timed in the same run, one scene
after another (so load drifts hit every method alike), greedy:

* ``plain``: no drafter; ``prompt_lookup``: the training-free reference;
* ``eagle_vlm[full]``: EagleVLM, the drafter reading all visual inputs (no compressor);
* ``eagle_vlm[prune|pool|conv|resample|text]``: each fixed compressor branch;
* ``eagle_vlm[elastic]``: the gate's choice per input.

Per task and method: tokens/s end to end (prefill included), speedup over ``plain`` on the
same items, tau (tokens per target forward), the drafter's seconds per generation (its
prefill and every draft), its visual inputs per image and its own prefill time (reading the prompt once), the gate's choices, and whether every output
equalled ``plain``'s (it must: a mismatch stops the run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..arguments import UserError, at_least, method_settings, writable_directory
from ..drafters import PromptLookup
from ..drafters.compress import BRANCHES
from ..drafters.eagle_vlm import EagleVlm, VlmRun
from ..machine import machine_info

BENCH_SEEDS = 2000  # held-out scenes from HELDOUT_SEEDS + this on (training's evaluation uses the first ones)
TASKS = ("caption", "qa")
METHODS = ("plain", "prompt_lookup", *(f"eagle_vlm[{b}]" for b in (*BRANCHES, "elastic")))


class RecordedEagleVlm(EagleVlm):
    """eagle_vlm that keeps each generation's state, so the bench can read what it chose."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.runs: list[VlmRun] = []

    def start(self, ctx) -> VlmRun:
        run = super().start(ctx)
        self.runs.append(run)
        return run


def items(count: int) -> list[tuple[str, int, str]]:
    """(task, scene seed, prompt line): ``count`` captions and ``count`` questions (kinds in turn)."""
    from ..zoo import scenes
    from ..zoo.vlm_recipe import DESCRIBE, HELDOUT_SEEDS

    first = HELDOUT_SEEDS + BENCH_SEEDS
    chosen = [("caption", first + i, DESCRIBE) for i in range(count)]
    kinds, rng = ("count", "colour", "where", "shape"), np.random.default_rng(0)
    seed = first + count
    while len(chosen) < 2 * count:
        scene, kind = scenes.make_scene(seed), kinds[(len(chosen) - count) % len(kinds)]
        pool = [q for k, q, _ in scene.questions() if k == kind]
        if pool:
            chosen.append(("qa", seed, pool[int(rng.integers(len(pool)))]))
        seed += 1
    return chosen


def make_drafter(method: str, weights: str | None, settings: dict):
    """``settings``: eagle_vlm's tree knobs (depth, top_k, total_tokens), for every branch alike."""
    if method == "plain":
        return None
    if method == "prompt_lookup":
        return PromptLookup()
    branch = method[len("eagle_vlm["):-1]
    return RecordedEagleVlm(weights=weights, compressor=branch, **settings)


def run(model, processor, chosen: list[tuple[str, int, str]], methods: list[str], weights: str | None,
        max_new_tokens: int, repeats: int, settings: dict | None = None, draft_size: str = "fixed",
        progress: bool = True) -> list[dict]:
    """One record per (item, method, repeat); every output checked equal to plain's."""
    from ..engine.loop import generate
    from ..models.vlm import processor_inputs
    from ..zoo import scenes

    drafters = {m: make_drafter(m, weights, settings or {}) for m in methods}
    records = []
    bar = tqdm(total=len(chosen) * len(methods) * repeats, desc="vlm bench", disable=not progress, file=sys.stderr)
    for task, seed, line in chosen:
        ids, inputs = processor_inputs(processor, line, [scenes.make_scene(seed).image()])
        reference = None
        for repeat in range(repeats):
            for method in methods:
                drafter = drafters[method]
                clock = time.perf_counter()
                out = generate(model, ids, drafter=drafter, max_new_tokens=max_new_tokens,
                               draft_size=draft_size if drafter is not None else "fixed", threads=None, **inputs)
                seconds = time.perf_counter() - clock
                tokens = out.sequences[0, ids.shape[1]:].tolist()
                if reference is None:
                    reference = tokens
                if tokens != reference:
                    raise AssertionError(f"{method} wrote other tokens than {methods[0]} on scene {seed} ({line!r})")
                record = {"task": task, "seed": seed, "method": method, "repeat": repeat, "seconds": seconds,
                          "new_tokens": out.stats.new_tokens, "steps": out.stats.steps,
                          "prefill_seconds": out.stats.prefill_seconds, "draft_seconds": out.stats.draft_seconds,
                          "visual_tokens": int((ids == model.config.image_token_id).sum())}
                if isinstance(drafter, RecordedEagleVlm):
                    state = drafter.runs.pop()
                    record.update(branch=state.branch, visual_inputs=state.visual_inputs,
                                  drafter_prompt_seconds=state.prompt_seconds)
                records.append(record)
                bar.update(1)
    bar.close()
    return records


def summarise(records: list[dict], methods: list[str]) -> list[dict]:
    """Per task (and over both: "all") and method: medians over repeats per item, then totals
    over items."""
    rows = []
    for task in (*TASKS, "all"):
        per_item: dict[tuple[str, int], list[dict]] = {}
        for r in records:
            if task in (r["task"], "all"):
                per_item.setdefault((r["method"], r["seed"]), []).append(r)
        if not per_item:
            continue
        seconds = {key: statistics.median(r["seconds"] for r in rs) for key, rs in per_item.items()}
        plain_total = sum(s for (m, _), s in seconds.items() if m == methods[0])
        for method in methods:
            mine = [(key, rs) for key, rs in per_item.items() if key[0] == method]
            total = sum(seconds[key] for key, _ in mine)
            first = [rs[0] for _, rs in mine]
            tokens, steps = sum(r["new_tokens"] for r in first), sum(r["steps"] for r in first)
            row = {"task": task, "method": method, "items": len(mine), "tokens_per_s": tokens / total,
                   "speedup": plain_total / total, "tau": tokens / steps if steps else 0.0,
                   "visual_tokens": statistics.mean(r["visual_tokens"] for r in first)}
            row["drafter_ms"] = 1000 * statistics.mean(statistics.median(r["draft_seconds"] for r in rs) for _, rs in mine)
            if "visual_inputs" in first[0]:
                row["drafter_visual_inputs"] = statistics.mean(r["visual_inputs"] for r in first)
                row["drafter_prompt_ms"] = 1000 * statistics.median(r["drafter_prompt_seconds"] for _, rs in mine
                                                                    for r in rs)
                row["gate"] = dict(Counter(r["branch"] for r in first))
            rows.append(row)
    return rows


def gate_choices(records: list[dict]) -> str:
    """The elastic gate's branch for each input (first repeat), as Markdown lines."""
    chosen = [r for r in records if r["method"] == "eagle_vlm[elastic]" and r["repeat"] == 0]
    if not chosen:
        return ""
    lines = ["", "The gate's choice per input (eagle_vlm[elastic]):", "",
             "| task | scene seed | branch | drafter visual inputs (of) |", "|---|---|---|---|"]
    lines += [f"| {r['task']} | {r['seed']} | {r['branch']} | {r['visual_inputs']} ({r['visual_tokens']}) |"
              for r in chosen]
    return "\n".join(lines) + "\n"


def markdown(rows: list[dict]) -> str:
    lines = ["| task | method | tok/s | speedup | tau | drafter ms / generation | drafter visual inputs (of) "
             "| drafter prefill ms | branches |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        visual = f"{r['drafter_visual_inputs']:.0f} ({r['visual_tokens']:.0f})" if "drafter_visual_inputs" in r else ""
        prefill = f"{r['drafter_prompt_ms']:.1f}" if "drafter_prompt_ms" in r else ""
        gate = ", ".join(f"{b} {n}" for b, n in sorted(r.get("gate", {}).items()))
        lines.append(f"| {r['task']} | {r['method']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['tau']:.2f} "
                     f"| {r['drafter_ms']:.1f} | {visual} | {prefill} | {gate} |")
    return "\n".join(lines) + "\n"


def chart(rows: list[dict], path: Path) -> None:
    """Speedup over plain decoding, one bar per method, grouped by task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    tasks = [t for t in (*TASKS, "all") if any(r["task"] == t for r in rows)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(tasks)
    for i, task in enumerate(tasks):
        values = [next((r["speedup"] for r in rows if r["task"] == task and r["method"] == m), 0.0) for m in methods]
        ax.bar([x + i * width for x in range(len(methods))], values, width, label=task)
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xticks([x + width * (len(tasks) - 1) / 2 for x in range(len(methods))], methods, rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("speedup over plain decoding (end to end)")
    ax.set_title("hasten vlm bench: zoo:vlm-tiny, CPU, greedy (outputs identical)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- command line -----------------------------------------------------------------------------------------
def _add(parser: argparse.ArgumentParser) -> None:
    subs = parser.add_subparsers(dest="vlm_command", required=True, parser_class=type(parser))
    bench = subs.add_parser("bench", help="eagle_vlm with and without visual compression on zoo:vlm-tiny",
                            description="eagle_vlm with and without visual compression on zoo:vlm-tiny")
    bench.add_argument("--model", default="zoo:vlm-tiny", help="an image-text target (default zoo:vlm-tiny)")
    bench.add_argument("--weights", help="eagle_vlm weights (default: beside the model)")
    bench.add_argument("--scenes", type=int, default=6, help="held-out scenes per task (default 6)")
    bench.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    bench.add_argument("--draft-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="an eagle_vlm setting for every branch, e.g. total_tokens=6 (repeatable)")
    bench.add_argument("--draft-size", choices=("fixed", "auto"), default="fixed",
                       help="draft depth per step: the drafter's own (fixed) or cost-aware (auto)")
    bench.add_argument("--max-new-tokens", type=int, default=96)
    bench.add_argument("--repeats", type=int, default=2, help="timed runs per item and method; the median counts")
    bench.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    bench.add_argument("--out", type=Path, default=Path("vlm-bench"), metavar="DIR",
                       help="output folder, checked writable before the run (default ./vlm-bench)")
    bench.add_argument("--no-progress", action="store_true")


def _run(args: argparse.Namespace) -> int:
    from transformers import AutoProcessor

    from ..loading import load_model, resolve_path

    at_least(args, 1, "scenes", "max_new_tokens", "repeats", "threads")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UserError(f"--methods: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(METHODS)}")
    if methods[0] != "plain":
        methods.insert(0, "plain")  # the reference every output and speedup is measured against
    settings = method_settings("eagle_vlm", EagleVlm.Settings, args.draft_arg)
    if "compressor" in settings:
        raise UserError("--draft-arg compressor=...: the methods name the compressor (eagle_vlm[BRANCH])")
    writable_directory(args.out)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    if getattr(model.config, "image_token_id", None) is None:
        raise UserError(f"--model {args.model}: not a vision-language model (no image_token_id in its config)")
    processor = AutoProcessor.from_pretrained(resolve_path(args.model))
    records = run(model, processor, items(args.scenes), methods, args.weights, args.max_new_tokens, args.repeats,
                  settings, args.draft_size, progress=not args.no_progress)
    rows = summarise(records, methods)
    report = {"model": args.model, "methods": methods, "eagle_vlm": settings, "draft_size": args.draft_size,
              "scenes": args.scenes, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "machine": machine_info(), "summary": rows, "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    table = markdown(rows) + gate_choices(records)
    (args.out / "results.md").write_text(table)
    chart(rows, args.out / "speedup.png")
    print(table)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}, {args.out / 'speedup.png'}")
    return 0


COMMANDS = [("vlm", "vision-language models: speculative decoding with visual compression (bench)", _add, _run)]
