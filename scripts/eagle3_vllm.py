"""hasten's EAGLE-3 drafter in hasten and, exported, in vLLM's CPU build, on the same prompts
(docs/scale-out.md, "EAGLE-3"): greedy tokens checked equal, per-position acceptance side by
side, tokens per second of each engine plain and speculative (and vLLM's n-gram).

    python scripts/eagle3_vllm.py --model ~/.cache/hasten/gguf/SmolLM2-135M-Instruct.Q4_1-* \\
        --drafter smollm2-eagle3 --per-task 1 --max-new-tokens 96 --threads 1 --out eagle3-vllm.json

vLLM runs from its own environment (``make vllm``), one engine per configuration, through
``hasten.bench.vllm_cpu.Worker`` (greedy, EOS ignored, float32, eager, no prefix caching);
hasten runs in this process with the same number of threads and a fixed chain of ``--depth``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from hasten.bench import vllm_cpu
from hasten.drafters.eagle3 import Eagle3
from hasten.engine.loop import generate
from hasten.export import export
from hasten.zoo.packing import unpacked


def hasten_run(model, prompts: list[list[int]], drafter, new_tokens: int) -> dict:
    """Tokens per prompt, seconds, and per-position drafted/accepted counts of hasten's loop."""
    tokens, seconds, drafted, accepted, steps = [], 0.0, [], [], 0
    for prompt in prompts:
        clock = time.perf_counter()
        out = generate(model, torch.tensor([prompt]), drafter=drafter, max_new_tokens=new_tokens, eos_token_id=[],
                       draft_size="fixed" if drafter is not None else None, threads=None)
        seconds += time.perf_counter() - clock
        tokens.append(out.sequences[0, len(prompt):].tolist())
        steps += out.stats.steps
        drafted = add(drafted, out.stats.drafted_at_depth)
        accepted = add(accepted, out.stats.accepted_at_depth)
    return {"tokens": tokens, "seconds": seconds, "drafted": drafted, "accepted": accepted, "steps": steps}


def vllm_run(model_dir: str, speculative: dict | None, prompts: list[list[int]], new_tokens: int,
             threads: int, max_model_len: int) -> dict:
    python = vllm_cpu.vllm_python()
    if python is None:
        raise SystemExit(f"vLLM is not installed: {vllm_cpu.INSTALL}")
    worker = vllm_cpu.Worker(python, {"model": model_dir, "dtype": "float32", "max_model_len": max_model_len,
                                      "speculative": speculative}, threads)
    tokens, seconds, drafts, accepted, steps = [], 0.0, 0, [], 0
    try:
        for prompt in prompts:
            answer = worker.ask({"prompt": prompt, "max_tokens": new_tokens})
            tokens.append(answer["tokens"])
            steps += max(1, len(answer["tokens"]) - answer["accepted"])  # one token per forward plus the accepted
            seconds += answer["seconds"]
            drafts += answer.get("drafts", 0)
            accepted = add(accepted, answer.get("accepted_per_position") or [])
    finally:
        worker.close()
    return {"tokens": tokens, "seconds": seconds, "drafted": [drafts] * len(accepted), "accepted": accepted,
            "steps": steps}


def add(a: list[int], b: list[int]) -> list[int]:
    return [x + y for x, y in zip(a + [0] * (len(b) - len(a)), b + [0] * (len(a) - len(b)))]


def rates(run: dict) -> list[float]:
    return [round(a / d, 4) if d else 0.0 for a, d in zip(run["accepted"], run["drafted"])]


def roundtrip(model, model_dir: str, drafter_dir: str, prompts: list[list[int]], new_tokens: int, depth: int = 3,
              threads: int = 1, max_model_len: int = 2048, ngram: bool = False, hasten_only: bool = False) -> dict:
    """Every engine's run on ``prompts`` (vLLM's unless ``hasten_only``); the drafter (packed or not)
    exported for vLLM into a temporary folder."""
    drafter_dir = str(unpacked(drafter_dir))  # the zoo ships modules packed
    runs = {"hasten": hasten_run(model, prompts, None, new_tokens),
            "hasten_eagle3": hasten_run(model, prompts, Eagle3(weights=drafter_dir, depth=depth), new_tokens)}
    with tempfile.TemporaryDirectory(prefix="hasten-eagle3-") as out:
        if hasten_only:
            return summarised(runs, "hasten", len(prompts) * new_tokens)
        export(drafter_dir, "vllm", out)
        runs["vllm"] = vllm_run(model_dir, None, prompts, new_tokens, threads, max_model_len)
        runs["vllm_eagle3"] = vllm_run(model_dir, {"method": "eagle3", "model": out, "num_speculative_tokens": depth},
                                       prompts, new_tokens, threads, max_model_len)
    if ngram:
        runs["vllm_ngram"] = vllm_run(model_dir, vllm_cpu.SPECULATIVE[vllm_cpu.VLLM_NGRAM], prompts, new_tokens,
                                      threads, max_model_len)
    return summarised(runs, "vllm", len(prompts) * new_tokens)


def summarised(runs: dict, reference: str, total: int) -> dict:
    """Each run with its tok/s, tau, acceptance by position and prompts identical to ``reference``'s."""
    for run in runs.values():
        run["tok_s"] = round(total / run["seconds"], 2)
        run["tau"] = round(total / run["steps"], 3)
        run["acceptance_by_position"] = rates(run)
        run["identical"] = sum(a == b for a, b in zip(run["tokens"], runs[reference]["tokens"]))
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the target's Hugging Face directory")
    parser.add_argument("--drafter", required=True, help="a directory `hasten train eagle3 --out` wrote")
    parser.add_argument("--per-task", type=int, default=1, help="Spec-Bench questions per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--depth", type=int, default=3, help="draft chain length (vLLM's num_speculative_tokens)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ngram", action="store_true", help="also vLLM's n-gram proposer")
    parser.add_argument("--hasten-only", action="store_true", help="hasten plain and eagle3 only (no vLLM)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from hasten.bench.spec_bench import spec_bench_tasks
    from hasten.loading import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model), AutoTokenizer.from_pretrained(args.model)
    tasks = spec_bench_tasks(tokenizer, args.per_task)
    prompts = [tokenizer(task.prompt, add_special_tokens=False)["input_ids"] for task in tasks]
    runs = roundtrip(model, str(Path(args.model).resolve()), args.drafter, prompts, args.max_new_tokens, args.depth,
                     args.threads, ngram=args.ngram, hasten_only=args.hasten_only)
    summary = {name: {k: run[k] for k in ("tok_s", "tau", "acceptance_by_position", "identical", "seconds")}
               for name, run in runs.items()}
    print(json.dumps({"prompts": len(prompts), "new_tokens": args.max_new_tokens, **summary}, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"tasks": [t.name for t in tasks], "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
