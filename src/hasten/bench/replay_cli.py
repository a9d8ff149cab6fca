"""``hasten record`` and ``hasten replay``: price drafters and sizing rules on recorded greedy
outputs in seconds, without the machine's noise (see :mod:`hasten.bench.replay`)."""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from ..api import AUTOREGRESSIVE, make_drafter
from ..arguments import UserError, writable_directory
from ..engine.sizing import CostAwareSize, FixedSize
from .cli import (
    _check_method_args, _csv, _settings_for, add_workload_arguments, check_workload, draft_sizes, load_tasks_and_models,
)
from .replay import Recording, check_replayable, copy_bound, record, replay

DEFAULT_METHODS = "prompt_lookup,lookahead"
OVERALL = "overall"


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="zoo name (zoo:smollm2-135m), local directory, hub id or .gguf")
    add_workload_arguments(parser)
    parser.add_argument("--out", required=True, metavar="FILE", help="the recording to write (JSON)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_record(args: argparse.Namespace) -> int:
    from ..machine import machine_info
    from .report import command_line

    check_workload(args)
    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; give the recording's file name, e.g. {out / 'rec.json'}")
    writable_directory(str(out.parent.resolve()))  # now, not after the recording
    tasks, input_ids, model, _ = load_tasks_and_models(args)
    prompts = [(task.category, ids[0].tolist()) for task, ids in zip(tasks, input_ids)]
    try:
        recording = record(model, prompts, args.max_new_tokens, args.model, args.backend, not args.no_progress)
    except ValueError as err:
        raise UserError(str(err)) from None
    recording.about = {"command": command_line(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                       "machine": machine_info(), "threads": torch.get_num_threads()}
    recording.save(out)
    tokens = sum(len(e.output) for e in recording.entries)
    print(f"hasten record: {len(prompts)} prompts, {tokens} greedy tokens, cost curve of {len(recording.curve.sizes)} "
          f"block sizes -> {out}", file=sys.stderr)
    return 0


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", help="a file written by `hasten record`")
    parser.add_argument("--methods", default=DEFAULT_METHODS,
                        help=f"comma-separated drafters that read tokens only (default {DEFAULT_METHODS})")
    parser.add_argument("--draft-size", default="auto,fixed", metavar="SIZES",
                        help="sizings to replay each method with, comma-separated (default auto,fixed); the first "
                        "keeps the method's name, the others are shown as METHOD@SIZE")
    parser.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting, KEY=VALUE for every method that has it or METHOD.KEY=VALUE (repeatable)")
    parser.add_argument("--no-bound", action="store_true", help="leave out the copy bound (an oracle copier)")
    parser.add_argument("--out", metavar="DIR", help="also write replay.json, replay.md and replay.png (a chart) there")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_replay(args: argparse.Namespace) -> int:
    try:
        recording = Recording.load(args.recording)
    except ValueError as err:
        raise UserError(str(err)) from None
    names = _csv(args.methods)
    sizes = draft_sizes(args.draft_size)
    _check_method_args(args.method_arg, names)
    settings = {name: _settings_for(name, args.method_arg) for name in names}
    variants = [(name, size, name if size == sizes[0] else f"{name}@{size}") for name in names for size in sizes]
    for name in names:  # every method checked before any replay
        if name == AUTOREGRESSIVE:
            raise UserError(f"--methods: {name} is the reference every replay is set against; name drafters")
        try:
            check_replayable(make_drafter(name, **settings[name]))
        except (ValueError, TypeError) as err:
            raise UserError(f"--methods: {err}") from None
    if args.out:
        writable_directory(args.out)  # now, not after the replay
    table = replay_table(recording, variants, settings, not args.no_bound, not args.no_progress)
    text = markdown(recording, table)
    print(text)
    if args.out:
        out = Path(args.out)
        (out / "replay.json").write_text(json.dumps({"recording": str(args.recording), "about": recording.about,
                                                     "table": table}, indent=1) + "\n")
        (out / "replay.md").write_text(text + "\n")
        chart(recording, table, out / "replay.png")
        print(f"hasten replay: wrote replay.json, replay.md, replay.png under {out}", file=sys.stderr)
    return 0


def replay_table(recording: Recording, variants: list[tuple[str, str, str]], settings: dict, bound: bool,
                 progress: bool) -> dict:
    """Per category (and overall): plain decoding's simulated tokens per second, and for each
    variant its speedup over plain and tau; with ``bound`` the copy bound's speedup."""
    sums: dict[str, dict[str, list[float]]] = {}  # category -> column -> [tokens, seconds, steps]

    def add(category: str, column: str, tokens: int, seconds: float, steps: int) -> None:
        for key in (category, OVERALL):
            cell = sums.setdefault(key, {}).setdefault(column, [0, 0.0, 0])
            cell[0] += tokens
            cell[1] += seconds
            cell[2] += steps

    # one rule per variant for every prompt, as the bench and a loaded model keep one (auto's
    # measured acceptance is the next prompt's prior)
    rules = {label: CostAwareSize(recording.curve) if size == "auto" else FixedSize() for _, size, label in variants}
    work = [(entry, variant) for entry in recording.entries for variant in [None, *variants]]
    for entry, variant in tqdm(work, desc="replaying", unit="run", disable=not progress):
        if variant is None:
            plain = replay(recording, entry, None, FixedSize())
            add(entry.category, AUTOREGRESSIVE, len(entry.output), plain.seconds, plain.stats.steps)
            if bound:
                add(entry.category, "copy bound", len(entry.output), copy_bound(recording, entry), 0)
            continue
        name, size, label = variant
        done = replay(recording, entry, make_drafter(name, **settings[name]), rules[label])
        add(entry.category, label, len(entry.output), done.seconds, done.stats.steps)
    table = {}
    order = [*(key for key in sums if key != OVERALL), OVERALL]
    labels = [AUTOREGRESSIVE, *(label for _, _, label in variants), *(["copy bound"] if bound else [])]
    for category in order:
        columns = {label: sums[category][label] for label in labels}
        plain_rate = columns[AUTOREGRESSIVE][0] / columns[AUTOREGRESSIVE][1]
        table[category] = {"plain tok/s": plain_rate, **{
            column: {"speedup": tokens / seconds / plain_rate, "tau": tokens / steps if steps else None}
            for column, (tokens, seconds, steps) in columns.items() if column != AUTOREGRESSIVE}}
    return table


def markdown(recording: Recording, table: dict) -> str:
    columns = [c for c in next(iter(table.values())) if c != "plain tok/s"]
    about = recording.about
    lines = [
        f"replay of {recording.model} ({recording.backend}; recorded {about.get('date', '?')}, "
        f"{len(recording.entries)} prompts); speedup vs plain decoding, forwards priced by the recorded cost "
        "curve, drafting timed on this machine; (tau)",
        "",
        "| category | plain tok/s | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for category, row in table.items():
        cells = []
        for column in columns:
            cell = row[column]
            tau = f" ({cell['tau']:.2f})" if cell["tau"] is not None else ""
            cells.append(f"{cell['speedup']:.2f}x{tau}")
        lines.append(f"| {category} | {row['plain tok/s']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(recording: Recording, table: dict, path: Path) -> None:
    """Speedup over plain decoding per category: a bar per method, the copy bound (when
    replayed) as an outline around them, the 1x line dashed."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    categories = list(table)
    methods = [c for c in table[categories[0]] if c not in ("plain tok/s", "copy bound")]
    fig, ax = plt.subplots(figsize=(min(14, 1.2 + 0.3 * len(categories) * (len(methods) + 1)), 4))
    width = 0.8 / max(1, len(methods))
    if "copy bound" in table[categories[0]]:
        bounds = [table[c]["copy bound"]["speedup"] for c in categories]
        ax.bar(range(len(categories)), bounds, 0.9, fill=False, edgecolor="black", linewidth=0.8,
               label="copy bound (oracle copier)")
    for i, method in enumerate(methods):
        where = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(categories))]
        ax.bar(where, [table[c][method]["speedup"] for c in categories], width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(categories)), categories, fontsize=8, rotation=20, ha="right")
    ax.set_ylabel("speedup vs plain decoding (replayed)")
    ax.set_title(f"replay: {Path(recording.model).name} ({recording.backend}), forwards priced by the recorded "
                 "cost curve", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


COMMANDS = [
    ("record", "record a model's greedy outputs and cost curve, for `hasten replay`", add_record_arguments,
     run_record),
    ("replay", "price drafters and draft sizing on a recording, without the model or the machine's noise",
     add_replay_arguments, run_replay),
]
