"""scripts/gpu-check (docs/gpu.md): its dry run passes on this CPU, every step is time-boxed and
what did not run is named, and the model parts travel and come back whole."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import model_parts, prepare, report, runner  # noqa: E402
from gpu_check.steps import Step  # noqa: E402


def test_the_dry_run_runs_every_step_and_reports_it(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    command = [sys.executable, str(ROOT / "scripts" / "gpu-check"), "--dry-run", str(out), "--work", str(work)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr + (out / report.LOG_NAME).read_text()
    found = json.loads((out / report.JSON_NAME).read_text())
    steps = {entry["step"]: entry for entry in found["steps"]}
    assert list(steps) == ["environment", "invariance-on-device", "cuda-tests", "greedy-on-device",
                           "sampling-law-on-device", "long-context", "real-model-bench", "drafter-training"]
    assert found["not_run"] == [] and all(entry["status"] == "passed" for entry in steps.values())
    assert steps["environment"]["findings"]["cuda_available"] is False
    assert steps["cuda-tests"]["findings"]["skipped"] > 0  # the CUDA cases, here
    assert all(steps[name]["findings"]["passed"] > 0 for name in ("greedy-on-device", "sampling-law-on-device"))
    for bench in ("long-context", "real-model-bench"):
        rows = steps[bench]["findings"]["overall"]
        assert len(rows) > 1 and all(row["identical"] == "1/1" for row in rows)
    assert {row["method"] for row in steps["long-context"]["findings"]["overall"]} == {
        "autoregressive", "triforce", "longspec"}
    trained = steps["drafter-training"]["findings"]
    assert 0 < trained["weights_bytes"] < 16 * 2**20 and "top1" in trained["heldout"]
    markdown = (out / report.MARKDOWN_NAME).read_text()
    assert all(f"## {name}: passed" in markdown for name in steps)
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8  # what a GPU machine's $OUT gives back


def test_dtype_changes_the_benches_dtype_only(tmp_path):
    from gpu_check.main import choose_sizes
    from gpu_check.steps import plan

    steps = {s.name: s for s in plan(choose_sizes(False, "float32"), sys.executable, tmp_path, tmp_path)}
    for bench in ("long-context", "real-model-bench"):
        command = list(steps[bench].command)
        assert command[command.index("--dtype") + 1] == "float32" and command[command.index("--device") + 1] == "cuda"
    assert choose_sizes(False, None).dtype == "bfloat16" and choose_sizes(True, None).dtype == "float32"


def sleeper(name: str, seconds: float, box_s: float, marker: Path) -> Step:
    """A step that starts a grandchild which would write ``marker`` after ``seconds``."""
    code = (f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
            f"\"import time, pathlib; time.sleep({seconds}); pathlib.Path(r'{marker}').write_text('late')\"]).wait()")
    return Step(name, "sleeps", (sys.executable, "-c", code), box_s)


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_step_past_its_box_is_killed_with_its_children_and_the_next_still_runs(tmp_path, jobs):
    steps = [sleeper("slow", 1.5, 0.5, tmp_path / "late"),
             Step("quick", "prints", (sys.executable, "-c", "print('still here')"), 30)]
    state = runner.run_plan(steps, {}, tmp_path / "log", {}, tmp_path, budget_s=60, blocked={}, jobs=jobs)
    assert state["slow"]["status"] == runner.TIMED_OUT and state["quick"]["status"] == runner.PASSED
    assert "still here" in state["quick"]["output_tail"]
    log = (tmp_path / "log").read_text()
    assert "----- slow: timed out" in log and "----- quick: passed" in log
    time.sleep(2)
    assert not (tmp_path / "late").exists(), "the timed-out step's grandchild should have been killed"


def test_what_did_not_run_is_named_with_its_reason(tmp_path):
    steps = [Step("done", "ran before", (sys.executable, "-c", "raise SystemExit(3)"), 5),
             Step("waits", "needs the model", (sys.executable, "-c", "pass"), 5, needs_real_model=True),
             Step("too-long", "a long box", (sys.executable, "-c", "pass"), 100)]
    state = {"done": {"status": runner.FAILED, "seconds": 1.0, "box_s": 5, "exit_code": 3}}
    state = runner.run_plan(steps, state, tmp_path / "log", {}, tmp_path, budget_s=50,
                            blocked={"waits": "waits for the real model: 1 of 4 parts"})
    assert state["done"]["exit_code"] == 3  # ran in an earlier command: not run again
    assert state["waits"] == {"status": "not run", "reason": "waits for the real model: 1 of 4 parts"}
    assert state["too-long"]["status"] == "not run" and "did not fit" in state["too-long"]["reason"]
    document = report.document("test", steps, state, [])
    assert document["not_run"] == ["waits", "too-long"]
    assert "Not run: waits, too-long." in report.markdown(document)


def test_a_model_travels_in_parts_and_comes_back_whole(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 40)
    parts = tmp_path / "parts"
    manifest = model_parts.split(source, parts, 3)
    assert [p["bytes"] for p in manifest["parts"]] == [3414, 3414, 3412]
    (parts / "model.gguf.part2").rename(tmp_path / "held-back")
    path, how = model_parts.assemble(parts, tmp_path / "there")
    assert path is None and "2 of 3 parts" in how and "model.gguf.part2" in how
    (tmp_path / "held-back").rename(parts / "model.gguf.part2")
    path, how = model_parts.assemble(parts, tmp_path / "there")
    assert path.read_bytes() == source.read_bytes() and "assembled from 3 parts" in how


def test_a_damaged_part_is_refused(tmp_path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"x" * 1000)
    parts = tmp_path / "parts"
    model_parts.split(source, parts, 2)
    (parts / "model.gguf.part1").write_bytes(b"y" * 500)
    path, how = model_parts.assemble(parts, tmp_path / "there")
    assert path is None and "damaged" in how and not (tmp_path / "there" / "model.gguf").exists()


@pytest.mark.parametrize("room_first, room_rest, parts", [(100, 100, 1), (60, 60, 2), (30, 40, 4), (40, 30, 4)])
def test_the_fewest_parts_that_fit(room_first, room_rest, parts):
    assert prepare.smallest_part_count(100, room_first, room_rest) == parts
