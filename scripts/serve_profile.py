"""Where a server's decode time goes: the scheduler ``hasten serve`` steps, driven in-process by
C closed-loop clients (each sends its next request when its last one ends) over Spec-Bench chat
questions, greedy, without HTTP; the scheduler built as the server builds it (its prefill budget
per step and fixed KV store). Prints tokens per second and the step's time split into
admission (prefills), drafting, the target's forward, verification and commit, and the rest.
docs/serve.md quotes its output (before and after issue 41).

    python scripts/serve_profile.py zoo:smollm2-135m --clients 8 --requests 24 --max-tokens 96
"""
from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import json
import statistics
import time

import torch

import hasten
from hasten.engine import batch as batch_module
from hasten.engine import sequence as sequence_module
from hasten.serve.app import scheduler_factory

SPENT: collections.Counter = collections.Counter()  # seconds by phase
CALLS: collections.Counter = collections.Counter()
POSITIONS: list[int] = []  # tokens each target forward ran


def timed(owner, name: str, phase: str) -> None:
    """Count the seconds ``owner.name`` takes under ``phase`` (once: nested calls count once)."""
    real = getattr(owner, name, None)
    if real is None:
        return

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        clock = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            SPENT[phase] += time.perf_counter() - clock
            CALLS[phase] += 1

    setattr(owner, name, wrapper)


def spec_bench_messages(per_category: int) -> list[list[dict]]:
    from hasten.bench.serve_load import spec_bench_questions

    return [[{"role": "user", "content": q}] for q in spec_bench_questions(per_category)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--method", default="prompt_lookup")
    parser.add_argument("--draft-size", default=None)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="as hasten.load's (default: its rule, bfloat16 on a CPU with it)")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048, help="as hasten serve's (its default)")
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="as hasten serve's (its default); 0: a "
                        "store that grows, as a library batch's")
    parser.add_argument("--warm", action="store_true", help="first run every prompt once, untimed (1 token each), so "
                        "the timed run finds the prompts in the prefix cache: decoding alone is measured")
    parser.add_argument("--out", help="append the result as a JSON line here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = hasten.load(args.model, args.method, draft_size=args.draft_size, threads=args.threads, dtype=args.dtype)
    prompts = [engine.encode_chat(m)[0].tolist() for m in spec_bench_messages(5)]
    scheduler = scheduler_factory(engine, args.max_batch, max_prefill_tokens=args.max_prefill_tokens,
                                  kv_cache_bytes=args.kv_cache_mib << 20 if args.kv_cache_mib else None)()
    if args.warm:
        for prompt in prompts:
            scheduler.submit(batch_module.Request(prompt, 1))
        scheduler.run()
    target = type(scheduler.target)
    timed(batch_module.Scheduler, "_admit", "admission (prefills)")
    timed(target, "forward_rows", "target forward")
    counted = target.forward_rows

    def forward_rows(self, rows, blocks, *args, **kwargs):
        POSITIONS.append(sum(len(block) for block in blocks))
        return counted(self, rows, blocks, *args, **kwargs)

    target.forward_rows = forward_rows
    from hasten.core.sizing import CostAwareSize

    timed(CostAwareSize, "plan", "sizing the batch's drafts")
    timed(sequence_module.Sequence, "propose", "drafting")
    timed(sequence_module.Sequence, "settle", "verify + commit")
    for name in ("verify_rows", "settle_all"):  # the batched verifier, where there is one
        timed(sequence_module, name, "verify + commit")
    sent = tokens = steps = rows = 0
    in_flight: set[int] = set()
    submitted: dict[int, float] = {}  # row id -> when it was sent
    answers: dict[int, list[int]] = {}  # row id -> its tokens, for a digest that two runs can compare
    first_token: list[float] = []  # seconds from sending to the first token, per request
    began = time.perf_counter()
    step_seconds = 0.0
    while sent < args.requests or in_flight:
        while len(in_flight) < args.clients and sent < args.requests:
            request = batch_module.Request(prompts[sent % len(prompts)], args.max_tokens)
            row_id = scheduler.submit(request)
            in_flight.add(row_id)
            submitted[row_id] = time.perf_counter()
            answers[row_id] = []
            sent += 1
        clock = time.perf_counter()
        updates = scheduler.step()
        step_seconds += time.perf_counter() - clock
        steps += 1
        rows += scheduler.last_step.batch_size if scheduler.last_step else 0
        for update in updates:
            answers.get(update.row_id, []).extend(update.tokens)
            if update.tokens and update.row_id in submitted:
                first_token.append(time.perf_counter() - submitted.pop(update.row_id))
            tokens += len(update.tokens)
            if update.finished:
                in_flight.discard(update.row_id)
    wall = time.perf_counter() - began
    digest = hashlib.sha1(json.dumps([answers[row] for row in sorted(answers)]).encode()).hexdigest()[:12]
    print(f"{args.model}, {args.method}, {args.clients} clients, {args.requests} requests of {args.max_tokens} "
          f"tokens, {args.threads} thread(s), batch path {target.__name__}")
    print(f"{tokens} tokens in {wall:.1f} s: {tokens / wall:.1f} tok/s; {steps} steps, {rows / max(steps, 1):.1f} rows "
          f"and {tokens / max(steps, 1):.2f} tokens per step, {sum(POSITIONS) / max(len(POSITIONS), 1):.2f} positions "
          f"per forward; time to first token p50 {1000 * statistics.median(first_token):.0f} ms; answers' digest {digest}")
    accounted = sum(SPENT.values())
    for phase, seconds in SPENT.most_common():
        print(f"  {phase:24s} {seconds:7.2f} s  {100 * seconds / step_seconds:5.1f} %  ({CALLS[phase]} calls)")
    print(f"  {'the rest of the step':24s} {step_seconds - accounted:7.2f} s  "
          f"{100 * (step_seconds - accounted) / step_seconds:5.1f} %")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps({"method": args.method, "clients": args.clients, "requests": args.requests,
                                "max_tokens": args.max_tokens, "warm": args.warm, "tokens": tokens,
                                "seconds": round(wall, 3), "tokens_per_second": round(tokens / wall, 2), "steps": steps,
                                "ttft_p50_ms": round(1000 * statistics.median(first_token), 1), "digest": digest,
                                "phases": {k: round(v, 3) for k, v in SPENT.items()},
                                "load": open("/proc/loadavg").read().split()[:3]}) + "\n")


if __name__ == "__main__":
    main()
