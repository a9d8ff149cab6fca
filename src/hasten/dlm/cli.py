"""``hasten dlm bench``: the thin command-line layer over hasten.dlm.bench."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..arguments import UserError, at_least, writable_directory
from ..machine import machine_info


def _add(parser: argparse.ArgumentParser) -> None:
    subs = parser.add_subparsers(dest="dlm_command", required=True, parser_class=type(parser))
    bench = subs.add_parser("bench", help="speed and quality of every diffusion-LM cache policy on zoo:dlm-tiny",
                            description="speed and quality of every diffusion-LM cache policy on zoo:dlm-tiny")
    bench.add_argument("--out", type=Path, default=Path("dlm-bench"), metavar="DIR",
                       help="output folder, checked writable before the run (default ./dlm-bench)")
    bench.add_argument("--prompts", type=int, default=6,
                       help="held-out function prompts (0 skips the main run; default 6)")
    bench.add_argument("--prompt-length", type=int, default=448, help="prompt tokens (default 448)")
    bench.add_argument("--gen-length", type=int, default=64, help="generated tokens (default 64)")
    bench.add_argument("--block-length", type=int, default=32, help="semi-autoregressive block (default 32)")
    bench.add_argument("--steps", type=int, default=64, help="denoising steps in all (default 64)")
    bench.add_argument("--long-prompt-length", type=int, default=960,
                       help="prompt tokens of the long-context run (0 skips it; default 960)")
    bench.add_argument("--long-prompts", type=int, default=2, help="prompts of the long-context run (default 2)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    bench.add_argument("--weights", type=Path, help="folder of the diffusion LM (default: zoo:dlm-tiny)")
    bench.add_argument("--heldout", action="store_true",
                       help="the held-out agreement check: prompts from hasten/dlm/heldout.py (written for it, never "
                            "tuned on) and its settings (dKV-Cache's schedules, SparseD's selections)")
    bench.add_argument("--no-progress", action="store_true")


def _run(args: argparse.Namespace) -> int:
    from . import bench

    at_least(args, 1, "prompt_length", "gen_length", "block_length", "steps", "threads")
    at_least(args, 0, "prompts", "long_prompt_length", "long_prompts")
    writable_directory(args.out)  # now, not after the whole run
    torch.set_num_threads(args.threads)
    weights = args.weights or bench.DLM_WEIGHTS
    if not (weights / "config.json").is_file():
        raise UserError(f"no diffusion LM at {weights}; train it with `python -m hasten.dlm.train`")
    model, tokenizer, judge = bench.load_models(weights)
    common = dict(gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                  decode=tokenizer.decode, progress=not args.no_progress)
    report = {"model": str(weights.name), "machine": machine_info()}
    draw = bench.heldout_tasks if args.heldout else bench.completion_tasks
    main_settings = bench.heldout_settings() if args.heldout else bench.default_settings()
    long_settings = bench.heldout_long_settings() if args.heldout else bench.long_context_settings()
    report["prompt_set"] = "heldout" if args.heldout else "zoo corpus held-out stdlib files"
    with torch.no_grad():
        if args.prompts:
            tasks = draw(tokenizer, args.prompts, args.prompt_length, args.gen_length, args.seed)
            report["main"] = bench.run_settings(model, judge, tasks, main_settings, **common)
        if args.long_prompt_length and args.long_prompts:
            long_tasks = draw(tokenizer, args.long_prompts, args.long_prompt_length, args.gen_length, args.seed + 1)
            report["long"] = bench.run_settings(model, judge, long_tasks, long_settings, **common)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    table = bench.markdown(report)
    (args.out / "results.md").write_text(table)
    bench.chart(report, args.out / "speed-quality.png")
    print(table)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}, {args.out / 'speed-quality.png'}")
    return 0


COMMANDS = [("dlm", "diffusion language models: cache and attention policies (bench)", _add, _run)]


if __name__ == "__main__":  # python -m hasten.dlm.cli bench ... (same as: hasten dlm bench ...)
    _parser = argparse.ArgumentParser(prog="hasten dlm")
    _add(_parser)
    sys.exit(_run(_parser.parse_args()))
