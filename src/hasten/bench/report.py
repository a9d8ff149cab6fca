"""Write a benchmark's results: results.json, results.md and two PNG charts.

Every number is written next to the machine and versions it was measured on.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


from ..arguments import counted
from .runner import AUTOREGRESSIVE, LLAMA_CPP, LLAMA_CPP_NOFLASH, OVERALL, not_identical_note

SPEEDUP_PNG, ACCEPTANCE_PNG = "speedup.png", "acceptance.png"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else (f"{value:.2f}" if digits == 2 else f"{value:.{digits}g}")


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def _other_side(kinds: dict[str, str]) -> tuple[str, str, str, str]:
    """What hasten is set against in a run: (kind, plain baseline's speedup key, its name, label)."""
    if "llama.cpp" in kinds.values():
        return "llama.cpp", "speedup_vs_llama_cpp", LLAMA_CPP, "llama.cpp"
    return "hf", "speedup_vs_hf_generate", "hf_generate", "HF"


def _plain_loops(kinds: dict[str, str]) -> list[tuple[str, str, str]]:
    """The other runtime's plain greedy loops a row is set against: (speedup key, baseline name,
    column title). On llama.cpp, its loop with flash attention on (the backend's reference) and,
    where it ran, off (llama-cpp-python's default), each titled with its setting."""
    _, plain_key, plain, label = _other_side(kinds)
    if plain != LLAMA_CPP:
        return [(plain_key, plain, f"vs {label} greedy")]
    loops = [(plain_key, plain, "vs llama.cpp greedy (flash on)")]
    if LLAMA_CPP_NOFLASH in kinds:
        loops.append(("speedup_vs_llama_cpp_noflash", LLAMA_CPP_NOFLASH, "vs llama.cpp greedy (flash off)"))
    return loops


def _note(row: dict, kinds: dict[str, str]) -> str:
    """Say so wherever a hasten method is slower than the other runtime's path, and where
    another engine's output was not the reference on every prompt."""
    different = not_identical_note(row)
    if different:
        return different
    if kinds.get(row["method"]) != "hasten":
        return ""
    slower = []
    against = [(key, name) for key, name, _ in _plain_loops(kinds)] + [("speedup_vs_hf_match", row["hf_match"])]
    for key, other in against:
        if row.get(key) is not None and row[key] < 1 and other not in slower:
            slower.append(other)
    return "; ".join(f"**slower than {name}**" for name in slower)


def best_per_category(results: dict) -> list[dict]:
    """Per category, hasten's fastest method against the other runtime's fastest path (Hugging
    Face's, or llama.cpp's on that backend; None where a side ran nothing): the comparison a user
    choosing between the two would make. The other side is under "hf" whichever runtime it is."""
    kinds = {m["name"]: m["kind"] for m in results["methods"]}
    other = _other_side(kinds)[0]
    table = []
    for category, rows in results["by_category"].items():
        best = {}
        for kind in ("hasten", other):
            mine = [r for r in rows if kinds.get(r["method"]) == kind]
            best[kind] = max(mine, key=lambda r: r["tokens_per_second"]) if mine else None
        ours, theirs = best["hasten"], best[other]
        table.append({
            "category": category, "hasten": ours, "hf": theirs,
            "ratio": ours["tokens_per_second"] / theirs["tokens_per_second"] if ours and theirs else None,
        })
    return table


def _best_lines(results: dict) -> list[str]:
    label = _other_side({m["name"]: m["kind"] for m in results["methods"]})[3]
    name = "Hugging Face" if label == "HF" else label
    lines = ["", f"## hasten's best vs {name}'s best, per category", "",
             f"| category | hasten best | tok/s | tau | {label} best | tok/s | tau | hasten / {label} |",
             "|---" * 8 + "|"]
    for b in best_per_category(results):
        ours, theirs = b["hasten"], b["hf"]
        if not (ours and theirs):
            continue
        lines.append(
            f"| {b['category']} | {ours['method']} | {ours['tokens_per_second']:.1f} | {_num(ours['tau'])} | "
            f"{theirs['method']} | {theirs['tokens_per_second']:.1f} | {_num(theirs['tau'])} | {_x(b['ratio'])} |"
        )
    return lines if len(lines) > 5 else []


def terminal_summary(results: dict) -> str:
    """What a run printed on the terminal says: the model and how it ran, every method's speed,
    tau and how many of its outputs were the reference's, and what that check means."""
    s = results["settings"]
    runs = "on llama.cpp, the GGUF file's own weights" if s["backend"] == "llama.cpp" else f"{s['dtype']} on {s['device']}"
    lines = [f"hasten bench: {s['model']} ({runs}), draft {s['draft'] or '-'}; "
             f"{counted(len(results['tasks']), 'prompt')}, {counted(s['max_new_tokens'], 'new token')} each, greedy",
             f"{'method':>24}  {'tok/s':>8}  {'vs AR':>7}  {'tau':>5}  identical to autoregressive"]
    rows = results["by_category"][OVERALL]
    for row in rows:
        lines.append(f"{row['method']:>24}  {row['tokens_per_second']:8.1f}  {_x(row['speedup_vs_ar']):>7}  "
                     f"{_num(row['tau']):>5}  {row['identical']}")
    differ = [row["method"] for row in rows if not_identical_note(row)]
    if differ:
        why = ("--count-differences" if s.get("count_differences")
               else "where kernels round otherwise: another engine, or llama.cpp without flash attention")
        lines.append(f"outputs compared token for token with hasten's {AUTOREGRESSIVE} and differences counted "
                     f"({why}): {', '.join(differ)} differed on some prompts")
    else:
        lines.append(f"every output was checked token for token against hasten's {AUTOREGRESSIVE}: all identical")
    lines += difference_lines(results)
    return "\n".join(lines)


def difference_lines(results: dict) -> list[str]:
    """Per method whose outputs differed: how many first differences were near-ties (the
    runner-up within measured rounding) and how many were not (bench/differences.py)."""
    verdicts: dict[str, dict[str, int]] = {}
    for task in results["by_task"]:
        for method, found in task.get("difference_classes", {}).items():
            counts = verdicts.setdefault(method, {})
            counts[found["verdict"]] = counts.get(found["verdict"], 0) + 1
    return [f"  {method}: first differences: " + ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
            for method, counts in verdicts.items()]


def markdown(results: dict) -> str:
    kinds = {m["name"]: m["kind"] for m in results["methods"]}
    m, s = results["machine"], results["settings"]
    lines = [
        "# hasten bench",
        "",
        f"- command: `{results['command']}`",
        f"- date: {results['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads"
        + (f", GPU {m['gpu']}" if m["gpu"] else ", no GPU")
        + (f"; load average {m['load_average'][0]} (1 min) as the run began" if m.get("load_average") else ""),
        f"- versions: python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, hasten {m['hasten']}",
        f"- model: {s['model']}, draft: {s['draft'] or '-'}; {s['max_new_tokens']} new tokens a prompt, greedy, "
        f"EOS ignored; median of {s['repeats']} interleaved repeats",
        _checked_line(results)
        + (" (chat prompts formatted by the model's chat template)" if s.get("chat_template") else ""),
        "",
        "Speedups are ratios of the summed per-prompt median times, so a category's speedup is what "
        "running all its prompts would see. tau = new tokens per target forward (for Hugging Face, "
        "counted from the target model's forward calls); efficiency = speedup vs AR / tau (1.0 would "
        "mean drafting and verifying cost nothing). KV MB (10^6 bytes): the largest KV cache a prompt's "
        "generation ended with, the target's (a lossy compression's or retrieval cache's own where one "
        "was used) and the drafter's own caches (- where not measured).",
    ]
    if results.get("skipped"):
        lines += ["", "Methods left out: " + "; ".join(f"{k} ({v})" for k, v in results["skipped"].items())]
    lines += _llama_cpp_loop_lines(results)
    lines += _best_lines(results)
    label = _other_side(kinds)[3]
    loops = _plain_loops(kinds)
    header = ("| method | tok/s | vs AR | " + "".join(f"{title} | " for _, _, title in loops)
              + f"vs {label} same path | tau | efficiency | target KV MB | drafter KV MB | note |")
    for category, rows in results["by_category"].items():
        lines += ["", f"## {category} ({_prompts(results, category, rows)} prompts)", "", header,
                  "|---" * (9 + len(loops)) + "|"]
        for r in rows:
            match = f"{_x(r['speedup_vs_hf_match'])} ({r['hf_match']})" if r["hf_match"] else "-"
            lines.append(
                f"| {r['method']} | {r['tokens_per_second']:.1f} | {_x(r['speedup_vs_ar'])} | "
                + "".join(f"{_x(r.get(key))} | " for key, _, _ in loops)
                + f"{match} | {_num(r['tau'])} | {_num(r['efficiency'])} | "
                f"{_mb(r.get('target_kv_bytes'))} | {_mb(r.get('drafter_kv_bytes'))} | {_note(r, kinds)} |"
            )
    lines += ["", "## Where hasten's time goes (all prompts, summed per-prompt medians)", "",
              "| method | total s | prefill s | draft s | verify s | target forwards | tau |", "|---" * 7 + "|"]
    lines += [
        f"| {r['method']} | {r['seconds']:.2f} | {r['median_prefill_seconds']:.2f} | {r['median_draft_seconds']:.2f} | "
        f"{r['median_verify_seconds']:.2f} | {r['steps']} | {r['tau']:.2f} |"
        for r in results["by_category"][OVERALL] if "median_verify_seconds" in r
    ]
    lines += _needle_lines(results)
    lines += _difference_table(results)
    hits = {t["task"]: t.get("needle_hit") for t in results["by_task"]}
    lines += ["", "## Prompts", "", "| task | category | prompt tokens | needle hit | source |", "|---" * 5 + "|"]
    lines += [f"| {t['name']} | {t['category']} | {t['prompt_tokens']} | {_yes_no(hits.get(t['name']))} | "
              f"{t['source']} |" for t in results["tasks"]]
    return "\n".join(lines) + "\n"


def _checked_line(results: dict) -> str:
    """What was checked of the outputs: all equal to the reference, but the methods whose
    outputs were compared and counted (another engine, llama.cpp without flash attention)."""
    if results["settings"].get("count_differences"):
        return f"- every method's tokens were compared with hasten {AUTOREGRESSIVE}'s, differences counted"
    counted_only = [m["name"] for m in results["methods"] if not m.get("exact", True)]
    but = f", but {', '.join(counted_only)}'s, compared and counted (note column)" if counted_only else ""
    return f"- every method's tokens were checked equal to hasten {AUTOREGRESSIVE}'s{but}"


def _llama_cpp_loop_lines(results: dict) -> list[str]:
    """On the llama.cpp backend: llama.cpp's own loops, each with its flash attention setting, and
    which of them write the backend's reference text."""
    loops = [m for m in results["methods"] if m["kind"] == "llama.cpp"]
    if not loops:
        return []
    named = ", ".join(f"{m['name']} (flash attention {'on' if m['settings'].get('flash_attn') else 'off'})"
                      for m in loops)
    text = (f"llama.cpp's own loops: {named}. Only the flash-on loops' greedy tokens are the backend's reference: "
            "it runs flash attention, with which a verification block is exact (docs/cpu.md, Exactness).")
    if any(not m["settings"].get("flash_attn") for m in loops):
        text += (" With flash attention off, llama-cpp-python's default, llama.cpp rounds otherwise and may write "
                 "other text: those outputs are compared and counted (note column), not required equal.")
    return ["", text]


def _prompts(results: dict, category: str, rows: list[dict]) -> int:
    """How many prompts a group's rows sum over: as its rows say (a stream's halves are no
    task's category), else (results written before rows said) its category's tasks."""
    if rows and "prompts" in rows[0]:
        return rows[0]["prompts"]
    return sum(1 for t in results["tasks"] if category in (OVERALL, t["category"]))


def _difference_table(results: dict) -> list[str]:
    """Every first difference with its classification (bench/differences.py)."""
    rows = [(task["task"], method, found) for task in results["by_task"]
            for method, found in task.get("difference_classes", {}).items()]
    if not rows:
        return []
    lines = ["", "## First differences from hasten's autoregressive output", "",
             "margin: the reference's top-2 logit gap there; rounding: the measured difference of the two "
             "computations' logits there (hasten methods: a verification block against one-token steps; "
             "other implementations: the model's own PyTorch forward against hasten's); gap: the top logit "
             "minus the differing token's (0: a tie); a near-tie when the gap is within the rounding.", "",
             "| task | method | new token | margin | gap | rounding | verdict |", "|---" * 7 + "|"]
    lines += [f"| {task} | {method} | {found['position']} | {_num(found.get('margin'), 4)} | "
              f"{_num(found.get('gap'), 4)} | {_num(found.get('rounding'), 4)} | "
              f"{found['verdict']} |" for task, method, found in rows]
    return lines


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "no")


def _needle_lines(results: dict) -> list[str]:
    """Needle accuracy: one number for every method, as every output equals autoregressive's."""
    hits = [t["needle_hit"] for t in results["by_task"] if "needle_hit" in t]
    if not hits:
        return []
    return ["", f"Needle accuracy: {sum(hits)}/{len(hits)} prompts continue with the needle's next lines exactly "
            "(the same for every method: every output equals autoregressive's)."]


def _speedup_chart(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    categories = list(results["by_category"])
    methods = [m for m in results["methods"] if m["name"] != AUTOREGRESSIVE]
    fig, ax = plt.subplots(figsize=(min(13, max(7, 0.25 * len(categories) * len(methods) + 2)), 4))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [
            next(r["speedup_vs_ar"] or 0 for r in results["by_category"][c] if r["method"] == method["name"])
            for c in categories
        ]
        offsets = [x + (i - (len(methods) - 1) / 2) * width for x in range(len(categories))]
        hatch = "//" if method["kind"] == "hf" else None  # Hugging Face baselines hatched
        ax.bar(offsets, values, width, label=method["name"], hatch=hatch, edgecolor="white")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("speedup vs hasten autoregressive")
    m = results["machine"]
    ax.set_title(f"{results['settings']['model']} on {m['cpu']}, threads: {m['torch_threads']} (hatched: Hugging Face)", fontsize=9)
    if methods:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never on them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _acceptance_chart(results: dict, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    drawn = 0
    for row in results["by_category"][OVERALL]:
        curve = row["acceptance_by_position"]
        if curve:  # hasten methods that drafted something
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=row["method"])
            drawn += 1
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no method drafted tokens", ha="center", transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction accepted (steps that drafted it)")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance per draft position, all prompts", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: dict, out_dir: str | Path) -> list[Path]:
    """results.json, results.md, speedup.png and acceptance.png under ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md", out / SPEEDUP_PNG, out / ACCEPTANCE_PNG]
    paths[0].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(results), encoding="utf-8")
    _speedup_chart(results, paths[2])
    _acceptance_chart(results, paths[3])
    return paths


def command_line() -> str:
    import shlex

    return shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])
