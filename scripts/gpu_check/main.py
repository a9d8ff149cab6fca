"""scripts/gpu-check: the command line (docs/gpu.md)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from . import report
from .model_parts import assemble
from .prepare import prepare
from .runner import FAILED, TIMED_OUT, load_state, run_plan, save_state
from .steps import DRY, GPU, ROOT, Sizes, plan, with_real_model, write_long_prompt

DEFAULT_WORK = Path("/tmp/hasten-gpu-check")  # kept between the commands of one warm machine
DEFAULT_BUDGET_S = 540  # a command may run 600 s


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__ + " " + (
        "Runs hasten's CUDA tests, the greedy-equality and sampling-law suites on the GPU, the long-context and "
        "real-model benchmarks and a short drafter training, each step time-boxed; writes gpu-check.json, "
        "gpu-check.md and gpu-check.log into OUTDIR. Run it again on the same warm machine to continue."))
    parser.add_argument("outdir", nargs="?", type=Path, help="where the reports (and trained weights) go")
    parser.add_argument("--dry-run", action="store_true", help="the same steps at tiny sizes on this CPU")
    parser.add_argument("--prepare", action="store_true",
                        help="on this machine: wheels and SmolLM2's parts into --parts, and print the run commands")
    parser.add_argument("--parts", type=Path, default=ROOT / ".gpu", help="wheels and model parts (default .gpu)")
    parser.add_argument("--work", type=Path, help=f"scratch kept between commands (default {DEFAULT_WORK}; "
                        "dry run: a new temporary folder)")
    parser.add_argument("--steps", help="comma-separated step names: only these")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds this command may spend on steps (default {DEFAULT_BUDGET_S})")
    parser.add_argument("--box", action="append", default=[], metavar="STEP=SECONDS", help="another time box")
    parser.add_argument("--again", action="store_true", help="run again the steps that already ran here")
    parser.add_argument("--dtype", help="the benches' dtype instead of the steps' own (GPU: bfloat16), e.g. float32")
    parser.add_argument("--jobs", type=int, help="steps at a time (default 1; dry run 2: its timings mean nothing)")
    args = parser.parse_args(argv)
    if not args.prepare and args.outdir is None:
        parser.error("give OUTDIR (or --prepare)")
    return args


def install_wheels(parts: Path, work: Path) -> str | None:
    """pip-install the carried wheels into ``work``/site once; returns that folder, or None."""
    wheels = sorted((parts / "wheels").glob("*.whl"))
    site = work / "site"
    if not wheels:
        return str(site) if site.is_dir() else None
    if not (site / ".installed").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(site), *map(str, wheels)], check=True)
        (site / ".installed").write_text("\n".join(w.name for w in wheels) + "\n")
    return str(site)


def step_environment(work: Path, site: str | None) -> dict[str, str]:
    paths = [str(ROOT / "src"), *([site] if site else []), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("HASTEN_CACHE", str(work / "cache"))
    return env


def boxed(steps, overrides: list[str]):
    boxes = {}
    for item in overrides:
        name, _, seconds = item.partition("=")
        boxes[name] = float(seconds)
    return [type(step)(**{**step.__dict__, "box_s": boxes.get(step.name, step.box_s)}) for step in steps]


def choose_sizes(dry_run: bool, dtype: str | None) -> Sizes:
    """The GPU's sizes or the dry run's, the benches in ``dtype`` where one is given."""
    sizes = DRY if dry_run else GPU
    return dataclasses.replace(sizes, dtype=dtype) if dtype else sizes


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.prepare:
        prepare(args.parts.resolve())
        return 0
    out = args.outdir.resolve()
    work = (args.work or (Path(tempfile.mkdtemp(prefix="gpu-check-")) if args.dry_run else DEFAULT_WORK)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    sizes = choose_sizes(args.dry_run, args.dtype)
    if args.dry_run:
        write_long_prompt(work)
    notes = [f"work folder {work}"]
    site = None if args.dry_run else install_wheels(args.parts, work)
    if site:
        notes.append(f"carried wheels installed in {site}")
    env = step_environment(work, site)
    steps = boxed(plan(sizes, sys.executable, out, work), args.box)
    if args.steps:
        wanted = set(args.steps.split(","))
        if wanted - {s.name for s in steps}:
            known = [s.name for s in steps]
            raise SystemExit(f"unknown steps {sorted(wanted - set(known))}; known: {known}")
        steps = [s for s in steps if s.name in wanted]
    blocked = {}
    if any(s.needs_real_model for s in steps):
        model, how = assemble(args.parts, work)
        notes.append(how)
        if model is None:
            blocked = {s.name: f"waits for the real model: {how}" for s in steps if s.needs_real_model}
        else:
            steps = [with_real_model(s, model) if s.needs_real_model else s for s in steps]
    state_file = work / "state.json"
    state = {} if args.again else load_state(state_file)
    mode = "dry run, CPU, tiny sizes" if args.dry_run else "GPU"

    def on_change(current: dict) -> None:
        save_state(state_file, current)
        report.write(out, report.document(mode, steps, current, notes))

    jobs = args.jobs or (2 if args.dry_run else 1)
    state = run_plan(steps, state, out / report.LOG_NAME, env, ROOT, args.budget, blocked, on_change, jobs,
                     logs=work / "step-logs")
    on_change(state)
    outcomes = [state[s.name]["status"] for s in steps]
    summary = ", ".join(f"{s.name} {o}" for s, o in zip(steps, outcomes))
    print(f"gpu-check: {summary}; report in {out / report.MARKDOWN_NAME}")
    return 1 if FAILED in outcomes or TIMED_OUT in outcomes else 0
