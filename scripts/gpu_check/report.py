"""The GPU check's report: what each step found (test counts, bench rows, training metrics),
as ``gpu-check.json`` and ``gpu-check.md`` in OUTDIR."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from .steps import Step

JSON_NAME, MARKDOWN_NAME, LOG_NAME = "gpu-check.json", "gpu-check.md", "gpu-check.log"
BENCH_COLUMNS = ("method", "tokens_per_second", "speedup_vs_ar", "tau", "identical")


def pytest_findings(xml_file: Path) -> dict:
    """Counts from a junit xml, and each failed or skipped test with its message."""
    suite = ElementTree.parse(xml_file).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    noted = []
    for case in suite.iter("testcase"):
        for outcome in ("failure", "error", "skipped"):
            found = case.find(outcome)
            if found is not None:
                message = (found.get("message") or "").splitlines()
                noted.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                              "message": message[0][:300] if message else ""})
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "not_passed": noted}


def bench_findings(directory: Path) -> dict:
    results = json.loads((directory / "results.json").read_text())
    overall = results["by_category"]["overall"]
    return {"settings": results["settings"], "machine": results.get("machine", {}), "skipped": results.get("skipped", {}),
            "overall": [{key: row.get(key) for key in BENCH_COLUMNS} for row in overall],
            "by_category": {category: [{key: row.get(key) for key in BENCH_COLUMNS} for row in rows]
                            for category, rows in results["by_category"].items() if category != "overall"},
            # {task: {method: the first new token where it left plain decoding's output}}
            "first_difference": {t["task"]: t["first_difference"]
                                 for t in results["by_task"] if "first_difference" in t},
            # {task: {method: position, margin, rounding, rank and verdict there}} (hasten/bench/differences.py)
            "difference_classes": {t["task"]: t["difference_classes"]
                                   for t in results["by_task"] if "difference_classes" in t}}


def _classified(found: dict | None) -> str:
    if not found or "margin" not in found:
        return ""
    return (f": {found['verdict']} (top-2 margin {found['margin']:.3g}, its token {found['gap']:.3g} below the top, "
            f"measured rounding {found['rounding']:.3g})")


def training_findings(directory: Path) -> dict:
    report = json.loads((directory / "training.json").read_text())
    weights = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors")
    return {"drafter": report.get("drafter"), "steps": report.get("steps"), "minutes": report.get("minutes"),
            "heldout": report.get("eval"), "distill": {k: v for k, v in report.get("distill", {}).items()
                                                      if isinstance(v, (int, float, str))},
            "weights_bytes": sum(p.stat().st_size for p in weights)}


def environment_findings(tail: str) -> dict:
    for line in reversed(tail.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def findings(step: Step, outcome: dict) -> dict | None:
    """What ``step`` left behind, read for the report (None when it left nothing readable)."""
    try:
        if step.kind == "environment":
            return environment_findings(outcome.get("output_tail", ""))
        if step.kind == "pytest":
            return pytest_findings(Path(step.results))
        if step.kind == "bench":
            return bench_findings(Path(step.results))
        if step.kind == "training":
            return training_findings(Path(step.results))
    except (OSError, ValueError, KeyError, ElementTree.ParseError):
        return None
    return None


def document(mode: str, steps: list[Step], state: dict, notes: list[str]) -> dict:
    entries = []
    for step in steps:
        outcome = dict(state.get(step.name, {"status": "not run", "reason": "not reached"}))
        if outcome["status"] not in ("not run", "running"):
            outcome["findings"] = findings(step, outcome)
        entries.append({"step": step.name, "what": step.what, "command": " ".join(step.command), **outcome})
    return {"mode": mode, "notes": notes, "steps": entries,
            "not_run": [e["step"] for e in entries if e["status"] in ("not run", "running")]}


def write(out: Path, report: dict) -> None:
    (out / JSON_NAME).write_text(json.dumps(report, indent=1) + "\n")
    (out / MARKDOWN_NAME).write_text(markdown(report))


def table(rows: list[dict], columns: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in columns) + " |" for row in rows]
    return lines


def markdown(report: dict) -> str:
    lines = [f"# hasten GPU check ({report['mode']})", ""]
    lines += [f"- {note}" for note in report["notes"]]
    lines += ["", *table([{"step": e["step"], "status": e["status"],
                           "seconds": f"{e['seconds']} / {e['box_s']:g}" if "seconds" in e else "",
                           "note": e.get("reason", "")} for e in report["steps"]], ("step", "status", "seconds", "note"))]
    if report["not_run"]:
        lines += ["", "Not run: " + ", ".join(report["not_run"]) + "."]
    for entry in report["steps"]:
        found = entry.get("findings")
        if entry["status"] in ("not run", "running"):
            continue
        lines += ["", f"## {entry['step']}: {entry['status']}", "", entry["what"] + ".", "", f"`{entry['command']}`", ""]
        if found and "overall" in found:
            settings = found["settings"]
            lines += [f"{settings.get('model')} on {settings.get('device')} ({settings.get('dtype')}), "
                      f"{settings.get('max_new_tokens')} new tokens; overall:", "",
                      *table(found["overall"], BENCH_COLUMNS)]
            classes = found.get("difference_classes", {})
            lines += [f"- {task}: {method} first differs from plain decoding at new token {at}"
                      + _classified(classes.get(task, {}).get(method))
                      for task, methods in found.get("first_difference", {}).items() for method, at in methods.items()]
        elif found and "tests" in found:
            lines.append(f"{found['passed']} passed, {found['failures']} failed, {found['errors']} errors, "
                         f"{found['skipped']} skipped of {found['tests']}")
            lines += [f"- {n['outcome']}: {n['test']}: {n['message']}" for n in found["not_passed"]]
        elif found and "heldout" in found:
            lines.append(f"{found['drafter']}: {found['steps']} steps in {found['minutes']} min, held-out "
                         f"{json.dumps(found['heldout'])}, weights {found['weights_bytes']:,} bytes")
        elif found:
            lines.append("```\n" + json.dumps(found, indent=1) + "\n```")
        if entry["status"] != "passed" and entry.get("output_tail"):
            lines += ["", "```", entry["output_tail"], "```"]
    return "\n".join(lines) + "\n"
