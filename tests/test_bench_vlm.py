"""``hasten vlm bench``: a tiny run on zoo:vlm-tiny writes its table, chart and records, with
every method's output checked equal to plain decoding; bad arguments fail before any work."""
import json

from hasten.bench import vlm as vlm_bench
from hasten.cli import main


def test_a_tiny_run(tmp_path):
    out = tmp_path / "bench"
    code = main(["vlm", "bench", "--scenes", "1", "--repeats", "1", "--max-new-tokens", "12", "--no-progress",
                 "--methods", "eagle_vlm[full],eagle_vlm[elastic]", "--draft-arg", "total_tokens=6", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "results.json").read_text())
    assert report["methods"] == ["plain", "eagle_vlm[full]", "eagle_vlm[elastic]"]  # plain added first
    assert report["eagle_vlm"] == {"total_tokens": 6}
    assert (out / "speedup.png").stat().st_size > 0
    rows = {(r["task"], r["method"]): r for r in report["summary"]}
    assert set(rows) == {(t, m) for t in ("caption", "qa", "all") for m in report["methods"]}
    assert rows["caption", "plain"]["speedup"] == 1.0 and rows["caption", "plain"]["tau"] == 1.0
    full, elastic = rows["all", "eagle_vlm[full]"], rows["all", "eagle_vlm[elastic]"]
    assert full["drafter_visual_inputs"] == full["visual_tokens"] == 256
    assert elastic["drafter_visual_inputs"] < 256 and sum(elastic["gate"].values()) == 2
    table = (out / "results.md").read_text()
    assert "| caption | eagle_vlm[full] |" in table
    assert table.count(f"| {elastic_branch(report)} |") == 2  # the gate's choice listed per input


def elastic_branch(report) -> str:
    (branch,) = {r["branch"] for r in report["records"] if r["method"] == "eagle_vlm[elastic]"}
    return branch


def test_items_are_held_out_scenes():
    from hasten.zoo.vlm_recipe import DESCRIBE, HELDOUT_SEEDS

    chosen = vlm_bench.items(3)
    assert [task for task, _, _ in chosen] == ["caption"] * 3 + ["qa"] * 3
    assert all(seed >= HELDOUT_SEEDS + vlm_bench.BENCH_SEEDS for _, seed, _ in chosen)
    assert all(line == DESCRIBE for task, _, line in chosen if task == "caption")
    assert all(line.endswith("?") for task, _, line in chosen if task == "qa")


def test_bad_arguments(tmp_path, capsys):
    assert main(["vlm", "bench", "--methods", "eagle_vlm[squeeze]", "--out", str(tmp_path)]) == 2
    assert "unknown eagle_vlm[squeeze]" in capsys.readouterr().err
    assert main(["vlm", "bench", "--draft-arg", "compressor=pool", "--out", str(tmp_path)]) == 2
    assert "the methods name the compressor" in capsys.readouterr().err
    assert main(["vlm", "bench", "--draft-arg", "depth=two", "--out", str(tmp_path)]) == 2
    assert "depth" in capsys.readouterr().err
    assert main(["vlm", "bench", "--model", "zoo:code-tiny", "--out", str(tmp_path)]) == 2
    assert "not a vision-language model" in capsys.readouterr().err
