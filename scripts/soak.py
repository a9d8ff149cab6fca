"""Soak ``hasten serve``: many requests of mixed lengths, streaming and not, some cancelled
mid-stream, some with drafting turned off, at C concurrent clients, against a server this
script starts (its own process, so its memory is the server's alone).

It passes when: no request fails; the server's resident memory and the bytes its KV cache holds
stay flat after warm-up (their peak over the run's second half at most ``--memory-slack`` above
their peak over its first half); and every completed greedy answer equals the same prompt's
answer decoded alone by ``Engine.generate`` (a cancelled one: a prefix of it). Exit status 0
when it passes, 1 when not; ``--out`` writes the numbers as JSON.

    python scripts/soak.py --model zoo:smollm2-135m --requests 2000 --clients 16
    python scripts/soak.py --model PATH --requests 60 --clients 8 --short   # what make test runs
    python scripts/soak.py --method suffix --method-arg max_cached_tokens=16384   # a pool that fills early
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

BUDGETS = (8, 24, 48, 96)  # max_tokens, mixed
SHORT_BUDGETS = (4, 8, 16)


@dataclass
class Job:
    prompt: int  # index into the prompts
    max_tokens: int
    stream: bool
    cancel_after: int | None  # chunks read before the client leaves (None: reads to the end)
    speculate: bool


@dataclass
class Outcome:
    job: Job
    text: str = ""
    finished: bool = False
    error: str | None = None


@dataclass
class Samples:
    """Server memory and KV bytes, sampled as requests complete."""

    done: list[int] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    kv: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def kv_bytes(base: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("hasten_kv_cache_bytes "):
                return float(line.split()[1])
    return 0.0


def start_server(args, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "hasten", "serve", "--model", args.model, "--method", args.method,
               "--port", str(port), "--max-batch", str(args.max_batch), "--threads", str(args.threads),
               "--dtype", args.dtype, "--kv-cache-mib", str(args.kv_cache_mib)]
    if args.draft_size:
        command += ["--draft-size", args.draft_size]
    for setting in args.method_arg:
        command += ["--method-arg", setting]
    from hasten.bench.serve_load import wait_until_healthy

    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_until_healthy(server, port, args.start_timeout,
                       lambda: "its errors: " + (server.stderr.read()[-3000:] if server.poll() is not None else "-"))
    return server


def prompts_for(args) -> list[str]:
    from hasten.bench.serve_load import builtin_prompts, spec_bench_questions

    if args.short:
        return builtin_prompts(8, context_chars=300)
    return spec_bench_questions(5) + builtin_prompts(10, context_chars=800)


def jobs_for(args, count: int) -> list[Job]:
    draw = random.Random(args.seed)
    budgets = SHORT_BUDGETS if args.short else BUDGETS
    jobs = []
    for _ in range(args.requests):
        stream = draw.random() < 0.5
        cancel = draw.randrange(1, 4) if stream and draw.random() < args.cancel_share else None
        jobs.append(Job(draw.randrange(count), draw.choice(budgets), stream, cancel, draw.random() >= 0.1))
    return jobs


async def one(client, name: str, prompt: str, job: Job) -> Outcome:
    outcome = Outcome(job)
    options = dict(model=name, prompt=prompt, max_tokens=job.max_tokens, temperature=0,
                   extra_body={"speculate": job.speculate})
    try:
        if not job.stream:
            answer = await client.completions.create(**options)
            outcome.text, outcome.finished = answer.choices[0].text, True
            return outcome
        stream = await client.completions.create(stream=True, **options)
        chunks = 0
        async for chunk in stream:
            if chunk.choices:
                outcome.text += chunk.choices[0].text or ""
                chunks += 1
                if chunk.choices[0].finish_reason is not None:
                    outcome.finished = True
            if job.cancel_after is not None and chunks >= job.cancel_after and not outcome.finished:
                await stream.close()  # the client leaves mid-stream: the server cancels the row
                break
    except Exception as err:  # noqa: BLE001 - every failure is counted and reported
        outcome.error = f"{type(err).__name__}: {err}"
    return outcome


async def drive(args, base: str, pid: int, prompts: list[str], jobs: list[Job]) -> tuple[list[Outcome], Samples]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600.0)
    name = (await client.models.list()).data[0].id
    gate = asyncio.Semaphore(args.clients)
    samples = Samples()
    outcomes: list[Outcome] = []
    every = max(1, len(jobs) // 40)

    async def gated(job: Job) -> None:
        async with gate:
            outcome = await one(client, name, prompts[job.prompt], job)
        outcomes.append(outcome)
        if len(outcomes) % every == 0:
            samples.done.append(len(outcomes))
            samples.rss.append(rss_bytes(pid))
            samples.kv.append(await asyncio.to_thread(kv_bytes, base))

    await asyncio.gather(*(gated(job) for job in jobs))
    await client.close()
    return outcomes, samples


def references(args, prompts: list[str], jobs: list[Job]) -> dict[tuple[int, int], str]:
    """Each (prompt, budget) asked for, decoded alone: plain greedy decoding of the same model."""
    import hasten

    engine = hasten.load(args.model, "autoregressive", threads=args.threads, dtype=args.dtype)
    wanted = sorted({(job.prompt, job.max_tokens) for job in jobs})
    return {(p, m): engine.generate(prompts[p], max_new_tokens=m).text for p, m in wanted}


def flat(values: list[float], slack: float) -> tuple[bool, float, float]:
    """Whether the second half's peak stays within ``slack`` (a fraction) of the first half's."""
    half = len(values) // 2
    first, second = max(values[:half] or [0.0]), max(values[half:] or [0.0])
    return second <= first * (1 + slack) + 1, first, second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="zoo:smollm2-135m")
    parser.add_argument("--method", default="prompt_lookup")
    parser.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the server's method (repeatable), e.g. max_cached_tokens=16384 for suffix")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="the server's (default: its own default)")
    parser.add_argument("--dtype", default="float32", help="the server's and the references' (one dtype for both)")
    parser.add_argument("--draft-size", choices=("auto", "fixed"), help="the server's (default: its own)")
    parser.add_argument("--cancel-share", type=float, default=0.15, help="streamed requests whose client leaves early")
    parser.add_argument("--memory-slack", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="small budgets and prompts (the test suite's run)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args()
    prompts = prompts_for(args)
    jobs = jobs_for(args, len(prompts))
    port = free_port()
    server = start_server(args, port)
    began = time.monotonic()
    try:
        outcomes, samples = asyncio.run(drive(args, f"http://127.0.0.1:{port}", server.pid, prompts, jobs))
    finally:
        seconds = time.monotonic() - began
        server.terminate()
        server.wait(60)
    expected = references(args, prompts, jobs)
    errors = [o for o in outcomes if o.error]
    cancelled = [o for o in outcomes if not o.error and not o.finished]
    wrong = [o for o in outcomes if not o.error and (
        o.text != expected[(o.job.prompt, o.job.max_tokens)] if o.finished
        else not expected[(o.job.prompt, o.job.max_tokens)].startswith(o.text))]
    rss_flat, rss_first, rss_second = flat(samples.rss, args.memory_slack)
    kv_flat, kv_first, kv_second = flat(samples.kv, args.memory_slack)
    report = {
        "model": args.model, "method": args.method, "method_args": args.method_arg, "requests": len(outcomes),
        "clients": args.clients,
        "seconds": round(seconds, 1), "errors": len(errors), "first_error": errors[0].error if errors else None,
        "completed": len(outcomes) - len(errors) - len(cancelled), "cancelled": len(cancelled),
        "streamed": sum(o.job.stream for o in outcomes), "plain_requests": sum(not o.job.speculate for o in outcomes),
        "answers_differing_from_alone": len(wrong),
        "rss_mib_peak_first_half": round(rss_first / 2**20, 1), "rss_mib_peak_second_half": round(rss_second / 2**20, 1),
        "kv_mib_peak_first_half": round(kv_first / 2**20, 2), "kv_mib_peak_second_half": round(kv_second / 2**20, 2),
        "memory_flat": rss_flat and kv_flat,
    }
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({**report, "samples": samples.__dict__}, f, indent=1)
    passed = not errors and not wrong and rss_flat and kv_flat
    print("soak: " + ("passed" if passed else "FAILED"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
