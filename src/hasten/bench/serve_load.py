"""``hasten serve-bench``: concurrent streaming requests with the official ``openai`` client.

For each concurrency level C it sends N requests, C at a time, and reports:

* throughput: output tokens per second of wall time (the usage the server reports);
* TTFT: time from sending a request to its first non-empty text chunk;
* inter-token latency (ITL, as vLLM's benchmark names it): the wait for each token after the
  first, from the streams' events: an event bringing k tokens (a speculative server sends
  several at once; the server's running usage, vLLM's ``continuous_usage_stats``, says how many,
  else 1 per event) after a gap of g seconds counts k waits of g / k. Pooled over every stream of
  a level, its p99 shows a step that stalls the streams (a long prompt's prefill);
* TPOT: per request, the time from the first to the last text divided by the tokens after the
  first (the mean of that request's ITL);
* tau: tokens per target forward, from the ``hasten`` field hasten's server adds.

Percentiles are p50, p90 and p99 over the requests of a level (ITL: over its tokens).

``long_prompt`` (``--long-prompt N``): one more client per level sends a prompt of about N tokens
once the level's streams have begun, so the level's ITL measures the others' streams while it
joins; its own TTFT and prompt tokens are reported apart (it is not in the level's figures).

Several servers (``--url NAME=URL``, repeated: hasten's and vLLM's OpenAI server, say) are
measured in one run, level by level in turn, on the same prompts; each answer is compared with
the first server's answer to the same prompt (``identical``: greedy answers should match
exactly), and ``--chart`` draws each server's throughput against the number of clients.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
# Spec-Bench's questions, vendored with hasten bench (read here directly: spec_bench.py's tasks need torch)
SPEC_BENCH = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
SPEC_BENCH_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")  # and MT-bench's 8, as one


@dataclass
class Outcome:
    """What one streamed request measured."""

    ttft: float | None = None  # seconds to the first text
    latency: float = 0.0  # seconds to the end of the stream
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    tpot: float | None = None  # seconds per token after the first
    waits: list[float] = field(default_factory=list, repr=False)  # each token's wait after the first (ITL)
    tau: float | None = None
    error: str | None = None
    text: str = field(default="", repr=False)


def wait_until_healthy(process, port: int, timeout: float, why: Callable[[], str]) -> None:
    """Wait for a server process started on ``port`` to answer ``/health``; SystemExit saying
    ``why()`` (where its output went) if it exits or does not answer within ``timeout`` seconds."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited; {why()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not start within {timeout} s; {why()}")


def prompts_from(source: str) -> list[str]:
    """``spec-bench[:N]`` (:func:`spec_bench_questions`, N per category, 5 by default) or a JSONL file."""
    name, _, count = source.partition(":")
    if name == "spec-bench":
        if count and (not count.isdigit() or not 1 <= int(count) <= 80):
            raise ValueError(f"--prompts {source}: spec-bench:N takes N from 1 to 80")
        return spec_bench_questions(int(count or 5))
    return read_prompts(source)


def read_prompts(path: str) -> list[str]:
    """Prompts from a JSONL file: ``{"prompt": str}`` a line, or Spec-Bench's ``{"turns": [str, ...]}`` (first turn)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"--prompts {path}: {getattr(err, 'strerror', None) or err}") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        turns = record.get("turns") if isinstance(record, dict) else None
        prompt = record.get("prompt", turns[0] if isinstance(turns, list) and turns else None) \
            if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{number}: expected {{\"prompt\": non-empty string}} (or Spec-Bench 'turns')")
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts


def spec_bench_questions(per_category: int) -> list[str]:
    """First turns of Spec-Bench's six categories, ``per_category`` each, taken from the end of each
    category (``hasten bench --tasks spec-bench`` takes them from the start): conversation's round
    robin over MT-bench's eight categories (the last question of each, then the one before), then
    translation, summarization, question answering, mathematical reasoning and RAG."""
    records = [json.loads(line) for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines() if line.strip()]
    mt_bench: dict[str, list[str]] = {}
    for record in records:
        if record["category"] not in SPEC_BENCH_CATEGORIES:
            mt_bench.setdefault(record["category"], []).append(record["turns"][0])
    conversation = [questions[-1 - rank] for rank in range(max(map(len, mt_bench.values())))
                    for questions in mt_bench.values() if rank < len(questions)]
    chosen = conversation[:per_category]
    for category in SPEC_BENCH_CATEGORIES:
        questions = [r["turns"][0] for r in records if r["category"] == category]
        chosen += questions[::-1][:per_category]
    return chosen


def builtin_prompts(count: int, context_chars: int = 1500) -> list[str]:
    """``count`` pieces of held-out standard-library code (never in the zoo models' training
    data), each ending after a function's signature line, so the answer is that function's body."""
    from ..zoo.corpus import heldout_files, read_text

    prompts = []
    for path in heldout_files():
        text = read_text(path)
        start = text.find("\ndef ", len(text) // 3)  # a function well inside the file: context before it
        end = text.find("\n", start + 1)
        if start < 0 or end < 0:
            continue
        prompts.append(text[max(0, start + 1 - context_chars) : end + 1])
        if len(prompts) == count:
            break
    if not prompts:
        raise ValueError("no held-out standard-library files to build prompts from: pass --prompts FILE")
    return prompts


class StreamClock:
    """Times one stream's events: the first text (TTFT), then each later text event's gap, shared
    among the tokens it brings (ITL). The tokens an event brings are the rise of the running
    usage since the last text event (tokens whose text was held back arrive with the next text),
    or 1 when the server sends no running usage."""

    def __init__(self, began: float):
        self.began = began
        self.first: float | None = None
        self.last: float | None = None
        self.counted = 0  # completion tokens the running usage had reached at the last text event
        self.waits: list[float] = []

    def event(self, now: float, text: bool, completion_tokens: int | None) -> None:
        if not text:
            return
        brought = 1 if completion_tokens is None else max(completion_tokens - self.counted, 1)
        if completion_tokens is not None:
            self.counted = completion_tokens
        if self.first is None:
            self.first = now
        else:
            self.waits.extend([(now - self.last) / brought] * brought)
        self.last = now

    def finish(self, outcome: Outcome) -> None:
        if self.first is None:
            return
        outcome.ttft = self.first - self.began
        outcome.waits = self.waits
        if outcome.completion_tokens > 1:
            outcome.tpot = (self.last - self.first) / (outcome.completion_tokens - 1)


async def one_request(client, model: str, prompt: str, chat: bool, max_tokens: int, temperature: float,
                      begun: asyncio.Event | None = None) -> Outcome:
    """One streamed request; ``begun`` is set at its first text."""
    outcome = Outcome()
    options = dict(model=model, max_tokens=max_tokens, temperature=temperature, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True})
    clock = StreamClock(time.perf_counter())
    try:
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **options)
        else:
            stream = await client.completions.create(prompt=prompt, **options)
        async for chunk in stream:
            piece = ""
            if chunk.choices:
                choice = chunk.choices[0]
                piece = (choice.delta.content or "") if chat else (choice.text or "")
            outcome.text += piece
            running = None
            if chunk.usage is not None:
                outcome.completion_tokens = running = chunk.usage.completion_tokens
                outcome.prompt_tokens = chunk.usage.prompt_tokens
            clock.event(time.perf_counter(), bool(piece), running if chunk.choices else None)
            if piece and begun is not None:
                begun.set()
            stats = (chunk.model_extra or {}).get("hasten")
            if isinstance(stats, dict) and "tau" in stats:
                outcome.tau = stats["tau"]
    except Exception as err:  # noqa: BLE001 - a failed request is counted and reported, not fatal to the run
        outcome.error = f"{type(err).__name__}: {err}"
    outcome.latency = time.perf_counter() - clock.began
    clock.finish(outcome)
    return outcome


async def run_level(client, model: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
                    temperature: float, chat: bool, long_prompt: str | None = None) -> tuple[dict, list[tuple[int, Outcome]]]:
    """One level: its summary, and each request's (prompt index, outcome). ``long_prompt``: sent
    by one more client once the level's first stream has begun, reported apart (``long_prompt``)."""
    gate = asyncio.Semaphore(concurrency)
    streaming = asyncio.Event()  # a stream of the level has shown its first text

    async def gated(index: int) -> tuple[int, Outcome]:
        async with gate:
            outcome = await one_request(client, model, prompts[index], chat, max_tokens, temperature, streaming)
            streaming.set()  # (should every stream fail, the long prompt still goes)
            return index, outcome

    async def joining() -> Outcome:
        await streaming.wait()
        return await one_request(client, model, long_prompt, chat, max_tokens, temperature)

    began = time.perf_counter()
    late = None if long_prompt is None else asyncio.ensure_future(joining())
    answered = await asyncio.gather(*(gated(i % len(prompts)) for i in range(requests)))
    summary = summarize([o for _, o in answered], concurrency, time.perf_counter() - began)
    if late is not None:
        summary["long_prompt"] = long_prompt_summary(await late)
    return summary, answered


def long_prompt_summary(outcome: Outcome) -> dict:
    """What the long prompt's own request measured."""
    rounded = lambda value: None if value is None else round(value, 6)  # noqa: E731
    return {"prompt_tokens": outcome.prompt_tokens, "ttft_seconds": rounded(outcome.ttft),
            "latency_seconds": rounded(outcome.latency), "completion_tokens": outcome.completion_tokens,
            "error": outcome.error}


def summarize(outcomes: list[Outcome], concurrency: int, wall_seconds: float) -> dict:
    done = [o for o in outcomes if o.error is None]
    tokens = sum(o.completion_tokens for o in done)
    taus = [o.tau for o in done if o.tau is not None]
    return {
        "concurrency": concurrency,
        "requests": len(outcomes),
        "errors": len(outcomes) - len(done),
        "first_error": next((o.error for o in outcomes if o.error), None),
        "wall_seconds": round(wall_seconds, 4),
        "output_tokens": tokens,
        "output_tokens_per_second": round(tokens / wall_seconds, 3) if wall_seconds > 0 else 0.0,
        "requests_per_second": round(len(done) / wall_seconds, 4) if wall_seconds > 0 else 0.0,
        "ttft_seconds": percentiles([o.ttft for o in done if o.ttft is not None]),
        "itl_seconds": percentiles([wait for o in done for wait in o.waits]),
        "tpot_seconds": percentiles([o.tpot for o in done if o.tpot is not None]),
        "latency_seconds": percentiles([o.latency for o in done]),
        "mean_tau": round(float(np.mean(taus)), 4) if taus else None,
    }


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    return {f"p{q}": round(float(np.percentile(values, q)), 6) for q in PERCENTILES}


@dataclass
class Server:
    """One server under test: what the table calls it, its API base URL and key."""

    name: str
    url: str
    api_key: str | None = None
    model: str | None = None  # the model to ask for (None: the one it lists)
    method: str | None = None  # hasten's method, from its model card (None: not a hasten server)


def servers_from(specs: list[str], api_key: str | None, model: str | None) -> list[Server]:
    """``URL`` or ``NAME=URL`` each; unnamed ones are called by their host and port."""
    found = []
    for spec in specs:
        name, _, url = spec.rpartition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        found.append(Server(name or url.split("://")[-1].split("/")[0], url, api_key, model))
    if len({s.name for s in found}) != len(found):
        raise ValueError("--url: give each server its own name (NAME=URL)")
    return found


def run(servers: list[Server], prompts: list[str], levels: list[int], requests: int | None, max_tokens: int,
        temperature: float, chat: bool, warmup: int = 1, long_prompt: int | None = None) -> dict:
    """Every concurrency level in turn, each server in turn within a level; raises ValueError
    when a server cannot be reached. ``long_prompt``: about that many tokens sent by one more
    client in each level, once its streams have begun (see the module's docstring)."""
    return asyncio.run(_run(servers, prompts, levels, requests, max_tokens, temperature, chat, warmup, long_prompt))


def long_text(prompts: list[str], chars: int, nonce: int) -> str:
    """About ``chars`` characters of the run's prompts one after another (repeated as needed),
    after a first line of its own (``nonce``), so that no server's prefix cache holds its start."""
    body = "\n\n".join(prompts)
    return f"Document {nonce}:\n" + (body * (chars // len(body) + 1))[:chars] + "\n\nSummarize the document above."


async def long_prompt_chars(client, server: Server, prompts: list[str], chat: bool, tokens: int) -> int:
    """The characters of :func:`long_text` that make about ``tokens`` prompt tokens on this server,
    from the prompt tokens it counts for two texts, without a body and with one (a request each,
    one token generated): what the opening line, the request and a chat template add, and the
    body's tokens per character."""
    counted = []
    for chars in (0, 4 * tokens):
        outcome = await one_request(client, server.model, long_text(prompts, chars, 0), chat, 1, 0.0)
        if outcome.error or not outcome.prompt_tokens:
            raise ValueError(f"--long-prompt: the request sizing the long prompt on {server.name} failed: "
                             f"{outcome.error or 'no usage in its stream'}")
        counted.append(outcome.prompt_tokens)
    per_char = max(counted[1] - counted[0], 1) / (4 * tokens)
    return max(round((tokens - counted[0]) / per_char), 1)


async def _connect(server: Server, prompts: list[str], chat: bool, max_tokens: int, temperature: float, warmup: int):
    import openai

    client = openai.AsyncOpenAI(base_url=server.url, api_key=server.api_key or "none", max_retries=0, timeout=600.0)
    try:
        listed = await client.models.list()
    except openai.APIConnectionError as err:
        raise ValueError(f"cannot reach a server at {server.url}: {err}; start one with `hasten serve`") from None
    except openai.APIStatusError as err:
        raise ValueError(f"{server.url}/models answered {err.status_code}: {err.message}") from None
    cards = list(listed.data)
    server.model = server.model or (cards[0].id if cards else None)
    if server.model is None:
        raise ValueError(f"{server.url} lists no model; pass --model")
    server.method = next(((c.model_extra or {}).get("method") for c in cards if c.id == server.model), None)
    for i in range(warmup):
        outcome = await one_request(client, server.model, prompts[i % len(prompts)], chat, max_tokens, temperature)
        if outcome.error:
            raise ValueError(f"the warm-up request to {server.name} failed: {outcome.error}")
    return client


async def _run(servers, prompts, levels, requests, max_tokens, temperature, chat, warmup, long_prompt) -> dict:
    if not prompts:
        raise ValueError("no prompts to send")
    clients = [await _connect(server, prompts, chat, max_tokens, temperature, warmup) for server in servers]
    chars = None if long_prompt is None else await long_prompt_chars(clients[0], servers[0], prompts, chat, long_prompt)
    reference: dict[int, str] = {}  # prompt index -> the first server's first answer to it
    results = []
    for number, level in enumerate(levels):
        count = requests or max(8, 4 * level)
        for position, (server, client) in enumerate(zip(servers, clients)):
            joining = None if chars is None else long_text(prompts, chars, 1 + number * len(servers) + position)
            summary, answered = await run_level(client, server.model, prompts, level, count, max_tokens, temperature,
                                                chat, joining)
            if position == 0:
                for index, outcome in answered:
                    if outcome.error is None:
                        reference.setdefault(index, outcome.text)
            compared = [(outcome.text == reference[index]) for index, outcome in answered
                        if outcome.error is None and index in reference]
            results.append({"server": server.name, **summary, "identical": sum(compared), "compared": len(compared)})
    for client in clients:
        await client.close()
    first = servers[0]
    return {"url": first.url, "model": first.model, "method": first.method, "chat": chat, "max_tokens": max_tokens,
            "temperature": temperature, "prompts": len(prompts), "reference": first.name, "long_prompt": long_prompt,
            "servers": [{"name": s.name, "url": s.url, "model": s.model, "method": s.method} for s in servers],
            "levels": results}


def table(results: dict) -> str:
    """A Markdown table of the levels, times in milliseconds; with several servers, one row per
    server and level, and how many of its answers equal the first server's."""
    ms = lambda value: "-" if value is None else f"{value * 1000:.1f}"  # noqa: E731
    several = len(results.get("servers", ())) > 1
    head = "| server " if several else ""
    lines = [", ".join(f"{s['name']}: model {s['model']}, method {s['method'] or '-'}" for s in results["servers"])
             if several else f"model {results['model']}, method {results['method'] or '?'}, "
                             f"max_tokens {results['max_tokens']}", ""]
    lines.append(f"{head}| concurrency | requests | errors | out tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
                 "| end-to-end p50/p90/p99 ms | tau |" + (f" answers equal to {results['reference']}'s |" if several else ""))
    lines.append(("| --- " if several else "") + "| ---: | ---: | ---: | ---: | --- | --- | --- | ---: |"
                 + (" ---: |" if several else ""))
    for level in results["levels"]:
        ttft, itl, latency = ("/".join(ms(level[key][f"p{q}"]) for q in PERCENTILES)
                              for key in ("ttft_seconds", "itl_seconds", "latency_seconds"))
        tau = "-" if level["mean_tau"] is None else f"{level['mean_tau']:.2f}"
        row = (f"| {level['concurrency']} | {level['requests']} | {level['errors']} | "
               f"{level['output_tokens_per_second']:.1f} | {ttft} | {itl} | {latency} | {tau} |")
        if several:
            row = f"| {level['server']} {row} {level['identical']}/{level['compared']} |"
        lines.append(row)
    joined = [level for level in results["levels"] if "long_prompt" in level]
    if joined:
        lines += ["", f"A prompt of about {results['long_prompt']} tokens joined each level once its streams had begun "
                  "(the ITL above is the other streams', meanwhile):"]
    for level in joined:
        long = level["long_prompt"]
        lines.append(f"- {level['server'] + ', ' if several else ''}{level['concurrency']} clients: "
                     f"{long['prompt_tokens'] or '?'} prompt tokens, TTFT {ms(long['ttft_seconds'])} ms, "
                     f"end-to-end {ms(long['latency_seconds'])} ms" + (f"; failed: {long['error']}" if long["error"] else ""))
    return "\n".join(lines)


def chart(results: dict, path: str) -> None:
    """Output tokens per second against concurrent clients, one line per server (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for server in results["servers"]:
        levels = [level for level in results["levels"] if level["server"] == server["name"]]
        axes.plot([lv["concurrency"] for lv in levels], [lv["output_tokens_per_second"] for lv in levels], marker="o",
                  label=server["name"])
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted({lv["concurrency"] for lv in results["levels"]}))
    axes.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel("output tokens / s")
    axes.set_title(f"{results['servers'][0]['model']}: throughput by load")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_json(results: dict, path: str) -> None:
    from ..machine import machine_info

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({**results, "machine": machine_info()}, indent=2) + "\n")
