"""Run steps, each in its own process group with its own time box: a step past its box is
killed with everything it started and reported "timed out", and the next one still runs.
What each step printed goes to one log; its outcome goes to a state file, so that a later
command on the same machine (while it is kept warm) continues where the last one stopped.
On a GPU the steps run one at a time (their timings are measurements); the CPU dry run may run
two at once (``jobs``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .steps import Step

PASSED, FAILED, TIMED_OUT, NOT_RUN = "passed", "failed", "timed out", "not run"
TAIL_LINES = 25
POLL_S = 0.1


@dataclass
class Running:
    step: Step
    process: subprocess.Popen
    output: IO[str]
    path: Path
    start: float


def start(step: Step, logs: Path, env: dict[str, str], cwd: Path) -> Running:
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"{step.name}.log"
    output = open(path, "w", encoding="utf-8")
    process = subprocess.Popen(step.command, stdout=output, stderr=subprocess.STDOUT, cwd=cwd,
                               env={**env, **step.env}, start_new_session=True)
    return Running(step, process, output, path, time.monotonic())


def finish(run: Running, log: Path, timed_out: bool) -> dict:
    """The step's outcome; its output is appended to ``log`` between two marker lines."""
    if timed_out:
        os.killpg(run.process.pid, signal.SIGKILL)  # the step and whatever it started
    code = run.process.wait()
    run.output.close()
    seconds = round(time.monotonic() - run.start, 1)
    status = TIMED_OUT if timed_out else PASSED if code == 0 else FAILED
    text = run.path.read_text(encoding="utf-8", errors="replace")
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"\n===== {run.step.name}: {' '.join(run.step.command)}\n{text}")
        out.write(f"----- {run.step.name}: {status} after {seconds} s (box {run.step.box_s:g} s, exit code {code})\n")
    return {"status": status, "seconds": seconds, "box_s": run.step.box_s, "exit_code": code,
            "output_tail": "\n".join(text.splitlines()[-TAIL_LINES:])}


def load_state(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def save_state(path: Path, state: dict) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(temporary, path)


def run_plan(steps: list[Step], state: dict, log: Path, env: dict[str, str], cwd: Path, budget_s: float,
             blocked: dict[str, str], on_change=lambda state: None, jobs: int = 1, logs: Path | None = None) -> dict:
    """Run every step not yet in ``state`` whose inputs are there (not in ``blocked``, which
    says why) and whose box still fits in ``budget_s`` from now, ``jobs`` at a time, in order;
    the others get a "not run" reason. ``on_change(state)`` after every change (the reports
    are rewritten). ``logs``: where each step's own output file goes (default: beside ``log``)."""
    logs = logs or log.parent / "step-logs"
    begin = time.monotonic()
    waiting = [s for s in steps if state.get(s.name, {}).get("status") not in (PASSED, FAILED, TIMED_OUT)]
    running: list[Running] = []
    while waiting or running:
        while waiting and len(running) < jobs:
            step = waiting.pop(0)
            left = budget_s - (time.monotonic() - begin)
            if step.name in blocked:
                state[step.name] = {"status": NOT_RUN, "reason": blocked[step.name]}
            elif step.box_s > left:
                why = f"its box ({step.box_s:g} s) did not fit in this command's {left:.0f} s left"
                state[step.name] = {"status": NOT_RUN, "reason": why}
            else:
                running.append(start(step, logs, env, cwd))
                state[step.name] = {"status": "running"}
            on_change(state)
        for run in list(running):
            over = time.monotonic() - run.start > run.step.box_s
            if run.process.poll() is not None or over:
                running.remove(run)
                state[run.step.name] = finish(run, log, timed_out=run.process.poll() is None)
                on_change(state)
        time.sleep(POLL_S if running else 0)
    return state
