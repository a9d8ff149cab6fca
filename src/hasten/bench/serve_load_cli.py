"""``hasten serve-bench``: measure a running ``hasten serve`` (or any OpenAI-compatible server)
under concurrent load, with :mod:`hasten.bench.serve_load`."""
from __future__ import annotations

import argparse
import os
import sys

from ..arguments import API_KEY_ENV, UserError, at_least, require_serve_extra

CLIENT_MODULES = ("openai",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", action="append", metavar="[NAME=]URL",
                        help="a server's API base URL (default http://127.0.0.1:8000/v1); repeat it to measure several "
                        "servers in one run, level by level (e.g. hasten=http://127.0.0.1:8000/v1 "
                        "vllm=http://127.0.0.1:8100/v1): each answer is compared with the first server's")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                        help=f"the server's API key (default: ${API_KEY_ENV})")
    parser.add_argument("--model", metavar="NAME", help="model name to ask for (default: the one the server lists)")
    parser.add_argument("--concurrency", default="1,4,16", metavar="LIST",
                        help="comma-separated numbers of requests in flight at once, each measured in turn "
                        "(default 1,4,16)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="requests per concurrency level (default: 4 x the level, at least 8)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="temperature of every request (default 0)")
    parser.add_argument("--chat", action="store_true", help="send each prompt as a user message to /chat/completions")
    parser.add_argument("--prompts", metavar="PATH", help="JSONL file of prompts ({prompt} or Spec-Bench turns), or "
                        "spec-bench[:N]: N first-turn questions of each of Spec-Bench's six categories (default 5), "
                        "from the end of each (hasten bench takes them from the start)")
    parser.add_argument("--num-prompts", type=int, default=16, metavar="N",
                        help="without --prompts: up to N built-in prompts, held-out standard-library code ending at a "
                        "function's signature (default 16)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N", help="untimed requests first (default 1)")
    parser.add_argument("--long-prompt", type=int, default=None, metavar="TOKENS",
                        help="in each level, one more client sends a prompt of about TOKENS tokens (e.g. 2048) once "
                        "the level's streams have begun: the level's ITL p99 then shows what its prefill costs the "
                        "running streams; its own TTFT is reported apart (default: none)")
    parser.add_argument("--out", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--chart", metavar="PATH", help="also draw throughput against concurrency as a PNG here")


def concurrency_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or any(level < 1 for level in levels):
        raise UserError(f"--concurrency {text!r}: give positive integers, comma-separated (e.g. 1,4,16)")
    return levels


def run(args: argparse.Namespace) -> int:
    require_serve_extra("serve-bench", CLIENT_MODULES)
    levels = concurrency_levels(args.concurrency)
    at_least(args, 1, "requests", "max_tokens", "num_prompts", "long_prompt")
    at_least(args, 0, "warmup")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    from . import serve_load as load

    prompts = load.prompts_from(args.prompts) if args.prompts else load.builtin_prompts(args.num_prompts)
    servers = load.servers_from(args.url or ["http://127.0.0.1:8000/v1"], args.api_key, args.model)
    results = load.run(servers, prompts, levels, args.requests, args.max_tokens, args.temperature, args.chat,
                       args.warmup, args.long_prompt)
    print(load.table(results))
    if args.out:
        load.write_json(results, args.out)
        print(f"hasten serve-bench: wrote {args.out}", file=sys.stderr)
    if args.chart:
        load.chart(results, args.chart)
        print(f"hasten serve-bench: drew {args.chart}", file=sys.stderr)
    failed = any(level["errors"] or (level.get("long_prompt") or {}).get("error") for level in results["levels"])
    return 1 if failed else 0


COMMANDS = [
    ("serve-bench", "measure a running hasten serve (or any OpenAI-compatible server) under concurrent load",
     add_arguments, run),
]
