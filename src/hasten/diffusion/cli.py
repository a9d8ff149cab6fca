"""``hasten diffusion bench``: the thin command-line layer over hasten.diffusion.bench."""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from ..arguments import at_least, writable_directory
from ..machine import cpu_model


def _add(parser: argparse.ArgumentParser) -> None:
    subs = parser.add_subparsers(dest="diffusion_command", required=True, parser_class=type(parser))
    bench = subs.add_parser("bench", help="speed and quality of every caching policy on the project's models",
                            description="speed and quality of every caching policy on the project's models")
    bench.add_argument("--models", choices=["dit", "policy", "all"], default="all")
    bench.add_argument("--out", type=Path, default=Path("diffusion-bench"), metavar="DIR",
                       help="output folder, checked writable before the run (default ./diffusion-bench)")
    bench.add_argument("--steps", type=int, default=50, help="DDIM steps per sample (default 50)")
    bench.add_argument("--images", type=int, default=12, help="DiT images compared (default 12)")
    bench.add_argument("--rollouts", type=int, default=100, help="policy episodes per setting (default 100)")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds (default 3)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    bench.add_argument("--dit-weights", type=Path, help="folder of DiT weights (default: the shipped ones)")
    bench.add_argument("--policy-weights", type=Path, help="folder of policy weights (default: the shipped ones)")
    bench.add_argument("--no-progress", action="store_true")


def _run(args: argparse.Namespace) -> int:
    from . import bench
    from .models import dit as dit_model
    from .models import policy as policy_model

    at_least(args, 1, "steps", "images", "rollouts", "repeats", "threads")
    writable_directory(args.out)  # now, not after the whole run
    torch.set_num_threads(args.threads)
    common = dict(steps=args.steps, repeats=args.repeats, seed=args.seed, progress=not args.no_progress)
    report = {"machine": cpu_model(), "cpus": os.cpu_count(), "threads": args.threads,
              "torch": torch.__version__, "python": platform.python_version()}
    try:
        import diffusers

        report["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    if args.models in ("dit", "all"):
        model = dit_model.load_dit(args.dit_weights or dit_model.WEIGHTS)
        report["dit"] = bench.bench_dit(model, args.out, images=args.images, settings=bench.dit_settings, **common)
    if args.models in ("policy", "all"):
        model, _ = policy_model.load_policy(args.policy_weights or policy_model.WEIGHTS)
        report["policy"] = bench.bench_policy(model, args.out, rollouts=args.rollouts, settings=bench.policy_settings,
                                              **common)
    (args.out / "results.json").write_text(json.dumps(report, indent=1))
    table = bench.markdown(report)
    (args.out / "results.md").write_text(table)
    print(table)
    print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}"
          + (f", {args.out / report['dit']['grid']}" if "dit" in report else ""))
    return 0


COMMANDS = [("diffusion", "feature caching for diffusion transformers (bench)", _add, _run)]


if __name__ == "__main__":  # python -m hasten.diffusion.cli bench ... (same as: hasten diffusion bench ...)
    _parser = argparse.ArgumentParser(prog="hasten diffusion")
    _add(_parser)
    with torch.no_grad():
        sys.exit(_run(_parser.parse_args()))
