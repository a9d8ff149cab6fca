"""Run methods on tasks, interleaved, check every output, and summarise with medians.

Honest timing (see DESIGN.md, "Measuring speed honestly"): all methods run in one process
on one machine, interleaved A, B, C, A, B, C, ... with the order rotated every repeat so
that drift (thermal, other load) falls on all of them alike; each method gets one untimed
warm-up; the reported time is the median over repeats. Every method must produce exactly
hasten's plain autoregressive tokens, or the benchmark stops with a LosslessnessError.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm import tqdm

from ..api import AUTOREGRESSIVE, make_drafter
from ..drafters.base import REGISTRY
from ..engine.inputs import check_positions
from ..engine.loop import generate
from ..engine.calibration import load_or_calibrate
from ..engine.sizing import default_size, sizing_rule
from ..models.hf import runtime_of
from ..core.stats import DecodeStats
from .differences import first_difference
from .tasks import Task

HF_GENERATE = "hf_generate"
OVERALL = "overall"  # the by_category key of all tasks together
# Hugging Face generate() settings of each baseline; "assistant_model" is filled with the draft.
HF_BASELINES = {
    HF_GENERATE: {},
    "hf_prompt_lookup": {"prompt_lookup_num_tokens": 10},
    "hf_assisted": {"assistant_model": None},
}
LLAMA_CPP = "llama_cpp"  # llama.cpp's own greedy decoding (bench/llamacpp.py), with --backend llama.cpp
LLAMA_CPP_NOFLASH = "llama_cpp_noflash"  # the same with flash attention off (llama-cpp-python's default)
# The path a user would otherwise run for the same idea, on Hugging Face or on llama.cpp.
COUNTERPARTS = {AUTOREGRESSIVE: (HF_GENERATE, LLAMA_CPP), "prompt_lookup": ("hf_prompt_lookup", "llama_cpp_lookup"),
                "draft_model": ("hf_assisted",)}


class LosslessnessError(RuntimeError):
    """A method's output differs from plain autoregressive decoding: a bug, never noise."""


# (input_ids [1, T], new tokens) -> (the new tokens, decode stats, seconds of the generate call);
# hasten's methods and Hugging Face's also take stop_at_eos=True (a task that ends at EOS: gec)
RunFn = Callable[..., tuple[list[int], DecodeStats, float]]


@dataclass
class Method:
    name: str
    kind: str  # "hasten" or "hf"
    run: RunFn
    settings: dict = field(default_factory=dict)  # recorded in results.json
    draft_size: str | None = None  # hasten drafters: "fixed" or "auto" (recorded too)
    # False for another engine's kernels (vLLM; Hugging Face below float32), whose rounding may flip
    # a near-tie: its outputs that differ from the reference are counted (``identical``), not fatal
    exact: bool = True
    close: Callable[[], None] | None = None  # frees what the method holds (a worker process)


def hasten_method(name: str, model, draft=None, draft_size: str | None = None, label: str | None = None,
                  **settings) -> Method:
    """A registered drafter (or "autoregressive"), a fresh drafter per run, greedy, EOS ignored.
    ``draft`` goes only to methods that declare they need a draft model. ``draft_size``:
    "fixed" or "auto" (see hasten.engine.sizing), unset meaning what it means everywhere
    (auto, for greedy decoding), one rule for all the method's runs, as a loaded model
    (``hasten.load``) and the server keep one: what auto sizing measured of the drafter's
    acceptance in earlier prompts is a later one's prior; ``label`` names the method in the
    results (default ``name``), so one drafter can be timed with both sizings side by side."""
    if name not in REGISTRY or not REGISTRY[name].needs_draft_model:
        draft = None
    make_drafter(name, draft, **settings)  # fail now, not in the middle of the benchmark
    draft_size = default_size(draft_size, sampled=False, seeded=False)
    rule = sizing_rule(draft_size)
    if draft_size == "auto" and name != AUTOREGRESSIVE:
        load_or_calibrate(model)  # the machine's cost curve, measured (or read) before anything is timed

    start = _new_tokens_start(model)

    def run(input_ids, max_new_tokens, stop_at_eos=False):
        drafter = make_drafter(name, draft, **settings)  # built outside the timed call
        clock = time.perf_counter()
        out = generate(model, input_ids, drafter=drafter, max_new_tokens=max_new_tokens,
                       eos_token_id=None if stop_at_eos else [], draft_size=rule,
                       threads=None)  # torch's threads: the bench's --threads, set for its process
        seconds = time.perf_counter() - clock
        return out.sequences[0, start(input_ids) :].tolist(), out.stats, seconds

    return Method(label or name, "hasten", run, settings, None if name == AUTOREGRESSIVE else draft_size)


def _new_tokens_start(model) -> Callable[[torch.Tensor], int]:
    """input_ids -> where the new tokens start in a generation's sequence: after the prompt, or
    for an encoder-decoder (whose sequence is the decoder's) after the decoder's start token."""
    if runtime_of(model).encoder_decoder:
        return lambda input_ids: 1
    return lambda input_ids: input_ids.shape[1]


def hf_method(name: str, model, draft=None) -> Method:
    """``model.generate`` greedy with the baseline's settings and no EOS stopping."""
    if name not in HF_BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(HF_BASELINES)}")
    kwargs = dict(HF_BASELINES[name])
    if "assistant_model" in kwargs:
        if draft is None:
            raise ValueError(f"baseline {name!r} needs a draft model: pass --draft")
        kwargs["assistant_model"] = draft
    pad = model.generation_config.pad_token_id
    pad = model.generation_config.eos_token_id if pad is None else pad  # only silences a warning

    start = _new_tokens_start(model)

    def run(input_ids, max_new_tokens, stop_at_eos=False):
        forwards = []  # target forward calls, for tau; the assistant's are not counted
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        try:
            clock = time.perf_counter()
            # eos_token_id=None: no stopping, as eos_token_id=[] for hasten. (min_new_tokens would
            # instead mask EOS out of the logits and change the greedy output.)
            # An explicit all-ones mask: without one, generate masks every prompt token equal to
            # the pad id, and chat templates write the pad/EOS id (e.g. <|im_end|>) between turns.
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens,
                eos_token_id=model.generation_config.eos_token_id if stop_at_eos else None, pad_token_id=pad, **kwargs
            )
            seconds = time.perf_counter() - clock
        finally:
            hook.remove()
        new = out[0, start(input_ids) :].tolist()
        if len(new) != max_new_tokens and not stop_at_eos:
            raise LosslessnessError(f"{name} produced {len(new)} tokens, expected {max_new_tokens}")
        # Hugging Face's first forward is the prefill and yields the first token: every
        # forward is a step. Only steps and tokens are known; times stay zero.
        return new, DecodeStats(steps=len(forwards), new_tokens=len(new)), seconds

    settings = {k: ("draft" if k == "assistant_model" else v) for k, v in kwargs.items()}
    # hasten's outputs equal Hugging Face's in float32; in a lower precision each engine rounds its
    # own way (hasten is exact to its own plain decoding there), so a differing output is counted
    return Method(name, "hf", run, settings, exact=model.dtype == torch.float32)


def sum_stats(parts: list[DecodeStats]) -> DecodeStats:
    """Counts and seconds added up, so tau and acceptance aggregate weighted by steps."""
    return sum(parts, DecodeStats())


@dataclass
class Cell:
    """One method on one task: each timed run's wall seconds and decode stats."""

    seconds: list[float] = field(default_factory=list)
    runs: list[DecodeStats] = field(default_factory=list)
    identical: bool = True  # the output equals the reference (always so for exact methods)


def not_identical_note(row: dict) -> str:
    """"output identical on k/n prompts" where a row's outputs were not all the reference's, else ""."""
    same, total = row.get("identical", "0/0").split("/")
    return "" if same == total else f"output identical on {same}/{total} prompts"


def _ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 4) if num and den else None


def compare(cells: dict[str, list[Cell]]) -> list[dict]:
    """One row per method over a set of tasks; times are per-task medians, summed.

    Speedups are ratios of those summed medians: the time-weighted aggregate, so a
    category's speedup is what a user running all its prompts would see.
    """
    seconds = {m: sum(statistics.median(c.seconds) for c in cs) for m, cs in cells.items()}
    rows = []
    for method, cs in cells.items():
        # Greedy decoding is deterministic: every repeat has the same counts, only times vary.
        stats = sum_stats([c.runs[0] for c in cs])
        tokens = stats.new_tokens
        speedup = _ratio(seconds.get(AUTOREGRESSIVE), seconds[method])
        tau = round(stats.mean_accepted, 4)
        match = next((m for m in COUNTERPARTS.get(method, ()) if m in cells), None)
        row = {
            "method": method,
            "tokens": tokens,
            "seconds": round(seconds[method], 6),
            "tokens_per_second": round(tokens / seconds[method], 3),
            "speedup_vs_ar": speedup,
            "speedup_vs_hf_generate": _ratio(seconds.get(HF_GENERATE), seconds[method]),
            "speedup_vs_llama_cpp": _ratio(seconds.get(LLAMA_CPP), seconds[method]),
            "speedup_vs_llama_cpp_noflash": _ratio(seconds.get(LLAMA_CPP_NOFLASH), seconds[method]),
            # the same idea on the other runtime (Hugging Face's or llama.cpp's), when it ran
            "hf_match": match,
            "speedup_vs_hf_match": _ratio(seconds.get(match), seconds[method]) if match else None,
            "tau": tau,
            "efficiency": _ratio(speedup, tau),
            # prompts whose output is the reference, token for token (all, or the run stops, for exact methods)
            "identical": f"{sum(c.identical for c in cs)}/{len(cs)}",
            "prompts": len(cs),  # the tasks this row sums over (a group need not be one category)
            "steps": stats.steps,
            # only hasten knows which draft positions were accepted
            "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position] or None,
            # peak KV memory over the tasks (None: not measured, e.g. Hugging Face generate)
            "target_kv_bytes": stats.target_kv_bytes,
            "drafter_kv_bytes": stats.drafter_kv_bytes,
        }
        if stats.verify_seconds > 0:  # hasten methods: where the time goes, summed per-task medians
            for part in ("prefill_seconds", "draft_seconds", "verify_seconds"):
                medians = (statistics.median(getattr(run, part) for run in c.runs) for c in cs)
                row[f"median_{part}"] = round(sum(medians), 6)
        rows.append(row)
    return rows


def _check(method: str, task: Task, output: list[int], reference: list[int]) -> None:
    if output != reference:
        at = first_difference(output, reference)
        got = output[at] if at < len(output) else "nothing"
        want = reference[at] if at < len(reference) else "nothing"
        raise LosslessnessError(
            f"{method} differs from hasten autoregressive on task {task.name!r} at new token {at}: "
            f"got {got}, expected {want}"
        )


def check_lengths(model, tasks: list[Task], input_ids: list[torch.Tensor], max_new_tokens: int) -> None:
    """Every task must fit the model's positions, checked before anything is timed."""
    runtime = runtime_of(model)
    for task, ids in zip(tasks, input_ids):
        try:
            check_positions(runtime, ids.shape[1], 0)
        except ValueError as err:  # the prompt alone is too long: no --max-new-tokens helps
            raise ValueError(f"task {task.name!r}: {err}; it needs a model with more positions "
                             "(e.g. zoo:code-tiny-long for the long tasks), or leave out that task") from None
        try:
            check_positions(runtime, ids.shape[1], max_new_tokens)
        except ValueError as err:
            raise ValueError(f"task {task.name!r}: {err}; use fewer --max-new-tokens or leave out that task") from None


def needle_hit(task: Task, output: list[int]) -> bool | None:
    """Whether ``output`` starts with the task's needle, token for token (None: no needle)."""
    if not task.expected_ids:
        return None
    return output[: len(task.expected_ids)] == list(task.expected_ids)


def _stop(task: Task) -> dict:
    """The run's keyword for a task that ends at EOS (only those pass it: not every method takes it)."""
    return {"stop_at_eos": True} if task.stop_at_eos else {}


def run_bench(
    methods: list[Method],
    tasks: list[Task],
    input_ids: list[torch.Tensor],
    max_new_tokens: int,
    repeats: int = 3,
    progress: bool | str = True,
    explain: Callable[[torch.Tensor, list[int], list[int], bool], dict] | None = None,
) -> dict:
    """Time every method on every task; returns per-task, per-category and overall rows.

    ``progress``: True (or "bar") a progress bar, "lines" one plain line per run on stderr (for logs:
    a run killed at a time limit still shows where its time went), False (or "none") nothing.
    ``explain``: (input_ids, reference, output, hasten method?) -> why an output differs
    (bench/differences.py), recorded per task under ``difference_classes``."""
    names = [m.name for m in methods]
    if AUTOREGRESSIVE not in names:
        raise ValueError(f"the methods must include {AUTOREGRESSIVE!r}: it is the reference output")
    if len(set(names)) != len(names):
        raise ValueError(f"a method is listed twice: {names}")
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    total = len(methods) * (1 + repeats * len(tasks))
    bar = tqdm(total=total, desc="bench", unit="run", disable=progress not in (True, "bar"))
    say = _run_lines(total) if progress == "lines" else (lambda *_: None)
    for method in methods:  # warm-up: first calls pay for allocation and lazy initialisation
        bar.set_postfix_str(f"warm-up {method.name}")
        tokens, _, seconds = method.run(input_ids[0], max_new_tokens, **_stop(tasks[0]))
        say("warm-up", method.name, len(tokens), seconds)
        bar.update()

    cells: dict[str, dict[str, Cell]] = {t.name: {} for t in tasks}
    outputs: dict[str, dict[str, list[int]]] = {t.name: {} for t in tasks}
    for task, ids in zip(tasks, input_ids):
        for r in range(repeats):
            shift = r % len(methods)
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(f"{task.name} {method.name}")
                tokens, stats, seconds = method.run(ids, max_new_tokens, **_stop(task))
                say(task.name, method.name, len(tokens), seconds)
                cell = cells[task.name].setdefault(method.name, Cell())
                cell.seconds.append(seconds)
                cell.runs.append(stats)
                if outputs[task.name].setdefault(method.name, tokens) != tokens:
                    _check(f"{method.name} (repeat {r + 1})", task, tokens, outputs[task.name][method.name])
                bar.update()
        reference = outputs[task.name][AUTOREGRESSIVE]
        for method in methods:  # checked once the task's reference exists, before moving on
            if method.exact:
                _check(method.name, task, outputs[task.name][method.name], reference)
            cells[task.name][method.name].identical = outputs[task.name][method.name] == reference
    bar.close()

    by_task = []
    kinds = {m.name: m.kind for m in methods}
    for t, ids in zip(tasks, input_ids):
        entry = {"task": t.name, "category": t.category, "rows": compare({m: [c] for m, c in cells[t.name].items()})}
        reference = outputs[t.name][AUTOREGRESSIVE]
        differences = {m: first_difference(out, reference) for m, out in outputs[t.name].items() if out != reference}
        if differences:  # where a method counted as not identical first left the reference (new-token index)
            entry["first_difference"] = differences
            if explain is not None:
                entry["difference_classes"] = {m: explain(ids, reference, outputs[t.name][m], kinds[m] == "hasten")
                                               for m in differences}
        hit = needle_hit(t, outputs[t.name][AUTOREGRESSIVE])  # every method's output is that one
        if hit is not None:
            entry["needle_hit"] = hit
        by_task.append(entry)
    groups: dict[str, list[Task]] = {}
    for t in tasks:
        groups.setdefault(t.category, []).append(t)
    groups[OVERALL] = list(tasks)
    by_category = {
        category: compare({m: [cells[t.name][m] for t in group] for m in names}) for category, group in groups.items()
    }
    return {
        "methods": [{"name": m.name, "kind": m.kind, "settings": m.settings, "exact": m.exact,
                     **({"draft_size": m.draft_size} if m.draft_size else {})} for m in methods],
        "by_task": by_task,
        "by_category": by_category,
    }


def _run_lines(total: int) -> Callable[[str, str, int, float], None]:
    """Prints ``[done/total] task method: N tokens in S s (T tok/s)`` on stderr, one line per run."""
    done = 0

    def say(task: str, method: str, tokens: int, seconds: float) -> None:
        nonlocal done
        done += 1
        rate = f" ({tokens / seconds:.1f} tok/s)" if seconds > 0 else ""
        print(f"bench [{done}/{total}] {task} {method}: {tokens} tokens in {seconds:.2f} s{rate}",
              file=sys.stderr, flush=True)

    return say


def hasten_method_names() -> list[str]:
    """Every method hasten can run: the plain loop and each registered drafter."""
    return [AUTOREGRESSIVE, *sorted(REGISTRY)]
