"""``hasten bench-json``: structured output timed. A JSON-extraction workload built from passages
hasten did not write (Spec-Bench's summarization, question-answering and retrieval-augmented
questions, data/spec_bench), one fixed JSON schema per category, answered by

* ``hasten_plain``: hasten's plain constrained decoding (the reference: one token a step, the
  argmax of the masked logits);
* ``hasten``: hasten's default method (prompt lookup, auto sizing) under the same constraint, with
  the text the grammar forces proposed as drafts;
* ``vllm`` and ``vllm_ngram``: vLLM's CPU build with its structured outputs (``structured_outputs``
  with the same schema; vLLM's default grammar backend and whitespace), plain and with n-gram
  speculation, in its own environment (``make vllm``).

Same model, prompts, token budget and thread count, in one process each, interleaved (the order
rotated every repeat), one untimed warm-up each; a method's speed is its tokens over its seconds
summed over the prompts, median over repeats. Every hasten output must equal ``hasten_plain``'s
(else the run stops); vLLM writes JSON with its own grammar's whitespace, so its identity with
hasten is reported, not required. Validity: the text parses as JSON and holds the schema's keys.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field

from ..api import Engine, load
from ..core.stats import DecodeStats
from ..structured import JsonSchema
from .runner import LosslessnessError
from .spec_bench import QUESTIONS
from .tasks import read_prompts
from . import vllm_cpu

CATEGORIES = ("summarization", "qa", "rag")
SCHEMAS = {
    "summarization": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 100},
        "people": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        "summary": {"type": "string", "maxLength": 400}},
        "required": ["title", "people", "summary"], "additionalProperties": False},
    "qa": {"type": "object", "properties": {
        "answer": {"type": "string", "maxLength": 200},
        "confidence": {"enum": ["high", "medium", "low"]}},
        "required": ["answer", "confidence"], "additionalProperties": False},
    "rag": {"type": "object", "properties": {
        "answerable": {"type": "boolean"},
        "answer": {"type": "string", "maxLength": 300},
        "quote": {"type": "string", "maxLength": 300}},
        "required": ["answerable", "answer", "quote"], "additionalProperties": False},
}
INSTRUCTIONS = {
    "summarization": "Reply with a JSON object: a title, the people the article names, and a summary.",
    "qa": "Reply with a JSON object: your answer, and your confidence (high, medium or low).",
    "rag": "Reply with a JSON object: whether the passage answers the question, the answer, and a quote "
           "from the passage that supports it.",
}
PLAIN, DEFAULT, VLLM, VLLM_NGRAM = "hasten_plain", "hasten", "vllm", "vllm_ngram"


@dataclass
class JsonTask:
    name: str
    category: str
    input_ids: list[int]
    schema: dict


@dataclass
class Outcome:
    tokens: list[int]
    text: str
    stats: DecodeStats
    seconds: float


@dataclass
class Tally:
    """One method's results: per repeat, its tokens and seconds over all prompts."""

    tokens: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)
    outputs: dict[str, Outcome] = field(default_factory=dict)  # the last repeat's, by task


def json_tasks(engine: Engine, per_category: int) -> list[JsonTask]:
    """The first ``per_category`` questions of each category, the instruction after the passage,
    through the model's chat template."""
    questions = read_prompts(QUESTIONS)
    tasks = []
    for category in CATEGORIES:
        chosen = [q for q in questions if q.category == category][:per_category]
        for question in chosen:
            content = f"{question.prompt}\n\n{INSTRUCTIONS[category]}"
            ids = engine.encode_chat([{"role": "user", "content": content}])[0].tolist()
            tasks.append(JsonTask(f"spec-bench-{question.name}", category, ids, SCHEMAS[category]))
    return tasks


def hasten_run(engine: Engine):
    import torch

    def run(task: JsonTask, max_new_tokens: int) -> Outcome:
        stats = DecodeStats()
        clock = time.perf_counter()
        out = engine.collect(torch.tensor([task.input_ids]), max_new_tokens=max_new_tokens,
                             constraint=JsonSchema(task.schema))
        return Outcome(out.token_ids, out.text, out.stats, time.perf_counter() - clock)

    return run


def vllm_run(name: str, engine: Engine, threads: int, max_model_len: int):
    """A vLLM worker (plain or n-gram) answering with vLLM's structured outputs; (run, close, settings)."""
    python = vllm_cpu.vllm_python()
    if python is None:
        return None
    dtype = str(engine.model.dtype).removeprefix("torch.")
    settings = {"model": vllm_cpu.model_directory(engine.model), "dtype": dtype, "max_model_len": max_model_len,
                "speculative": vllm_cpu.SPECULATIVE[name]}
    worker = vllm_cpu.Worker(python, settings, threads)
    eos = {engine.tokenizer.eos_token_id}

    def run(task: JsonTask, max_new_tokens: int) -> Outcome:  # the text without EOS, as hasten's
        answer = worker.ask({"prompt": task.input_ids, "max_tokens": max_new_tokens, "stop_at_eos": True,
                             "structured": {"json": task.schema}})
        tokens = answer["tokens"]
        steps = max(1, len(tokens) - answer["accepted"])
        stats = DecodeStats(steps=steps, new_tokens=len(tokens), accepted_tokens=answer["accepted"])
        text = engine.tokenizer.decode([t for t in tokens if t not in eos])
        return Outcome(tokens, text, stats, answer["seconds"])

    recorded = {"vllm": worker.ready.get("vllm"), "dtype": dtype, "speculative_config": vllm_cpu.SPECULATIVE[name],
                "structured_outputs": "vLLM's defaults (backend auto, any whitespace)"}
    return run, worker.close, recorded


def valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == set(schema["required"])


def run_bench(model: str, per_category: int, max_new_tokens: int, repeats: int, threads: int, with_vllm: bool,
              progress=print) -> dict:
    engine = load(model, "prompt_lookup", dtype="float32", threads=threads)
    plain = Engine(engine.model, engine.tokenizer, None, "autoregressive", threads=threads)
    tasks = json_tasks(engine, per_category)
    longest = max(len(task.input_ids) for task in tasks) + max_new_tokens
    methods = {PLAIN: (hasten_run(plain), None), DEFAULT: (hasten_run(engine), None)}
    settings = {PLAIN: {"method": "autoregressive"}, DEFAULT: {"method": "prompt_lookup", "draft_size": "auto"}}
    if with_vllm:
        for name in (VLLM, VLLM_NGRAM):
            made = vllm_run(name, engine, threads, longest + 16)
            if made is not None:
                methods[name] = made[:2]
                settings[name] = made[2]
    tallies = {name: Tally() for name in methods}
    try:
        warm = {task.category: task for task in tasks}.values()  # every schema compiled (and cached) before timing
        for name, (run, _) in methods.items():
            for task in warm:
                run(task, 8)
        order = list(methods)
        for repeat in range(repeats):
            totals = {name: [0, 0.0] for name in methods}
            for task in tasks:
                for name in order:
                    outcome = methods[name][0](task, max_new_tokens)
                    totals[name][0] += len(outcome.tokens)
                    totals[name][1] += outcome.seconds
                    tally = tallies[name]
                    tally.outputs[task.name] = outcome
                    if repeat == repeats - 1:
                        tally.stats = tally.stats + outcome.stats
                check_identity(tallies, task)
            for name, (count, seconds) in totals.items():
                tallies[name].tokens.append(count)
                tallies[name].seconds.append(seconds)
            progress(f"repeat {repeat + 1}/{repeats}: " + ", ".join(
                f"{name} {count / seconds:.1f} tok/s" for name, (count, seconds) in totals.items()))
            order = order[1:] + order[:1]
    finally:
        for _, close in methods.values():
            if close is not None:
                close()
    return summary(tallies, tasks, settings, model, per_category, max_new_tokens, repeats, threads)


def check_identity(tallies: dict[str, Tally], task: JsonTask) -> None:
    reference = tallies[PLAIN].outputs[task.name].tokens
    got = tallies[DEFAULT].outputs[task.name].tokens
    if got != reference:
        raise LosslessnessError(f"{DEFAULT} on {task.name} differs from {PLAIN}: {got} != {reference}")


def summary(tallies, tasks, settings, model, per_category, max_new_tokens, repeats, threads) -> dict:
    rows = {}
    plain_speed = None
    for name, tally in tallies.items():
        speed = statistics.median(t / s for t, s in zip(tally.tokens, tally.seconds))
        plain_speed = speed if name == PLAIN else plain_speed
        outputs, reference = tally.outputs, tallies[PLAIN].outputs
        rows[name] = {
            "tokens_per_second": round(speed, 2),
            "speedup_vs_hasten_plain": None,
            "tau": round(tally.stats.mean_accepted, 3),
            "forced_share": round(tally.stats.forced_share, 3) if name in (PLAIN, DEFAULT) else None,
            "valid": sum(valid(outputs[t.name].text, t.schema) for t in tasks),
            "identical_to_hasten_plain": sum(outputs[t.name].text == reference[t.name].text for t in tasks),
            "new_tokens": tally.tokens[-1],
            "settings": settings[name],
        }
    for row in rows.values():
        row["speedup_vs_hasten_plain"] = round(row["tokens_per_second"] / plain_speed, 3)
    return {"model": model, "tasks": len(tasks), "per_category": per_category, "categories": list(CATEGORIES),
            "max_new_tokens": max_new_tokens, "repeats": repeats, "threads": threads, "dtype": "float32",
            "load": os.getloadavg(), "methods": rows,
            "texts": {name: {t.name: tallies[name].outputs[t.name].text for t in tasks} for name in tallies}}


def markdown(result: dict) -> str:
    lines = ["| method | tok/s | vs hasten plain | tau | forced share | valid | identical to hasten plain |",
             "|---|---|---|---|---|---|---|"]
    total = result["tasks"]
    for name, row in result["methods"].items():
        forced = "-" if row["forced_share"] is None else f"{row['forced_share']:.0%}"
        lines.append(f"| {name} | {row['tokens_per_second']:.1f} | {row['speedup_vs_hasten_plain']:.2f}x | "
                     f"{row['tau']:.2f} | {forced} | {row['valid']}/{total} | "
                     f"{row['identical_to_hasten_plain']}/{total} |")
    return "\n".join(lines)


def chart(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["methods"])
    speeds = [result["methods"][name]["tokens_per_second"] for name in names]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar(names, speeds, color=["#999999", "#1f77b4", "#bbbbbb", "#ff7f0e"][: len(names)])
    for bar, speed in zip(bars, speeds):
        ax.text(bar.get_x() + bar.get_width() / 2, speed, f"{speed:.1f}", ha="center", va="bottom")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"JSON extraction, {result['model']}, {result['tasks']} Spec-Bench prompts, "
                 f"{result['threads']} thread", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command ----------------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--model", default="zoo:smollm2-135m", help="a chat model (default zoo:smollm2-135m)")
    parser.add_argument("--per-category", type=int, default=5, help="Spec-Bench questions per category (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="token budget per answer (default 128)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per method and prompt (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every method (default 1)")
    parser.add_argument("--baselines", choices=("auto", "none"), default="auto",
                        help="auto: vLLM plain and n-gram with structured outputs where `make vllm` built vLLM")
    parser.add_argument("--out", default="bench-json", help="folder for results.json, results.md and speed.png")


def run(args) -> int:
    from pathlib import Path

    from ..arguments import apply_threads

    apply_threads(args.threads)
    result = run_bench(args.model, args.per_category, args.max_new_tokens, args.repeats, args.threads,
                       args.baselines == "auto")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    table = markdown(result)
    (out / "results.md").write_text(table + "\n")
    chart(result, out / "speed.png")
    print(table)
    return 0


COMMANDS = [("bench-json", "time structured output (JSON extraction on Spec-Bench passages): hasten against "
             "its plain constrained decoding and vLLM's structured outputs", add_arguments, run)]
