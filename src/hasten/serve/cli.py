"""``hasten serve`` (the OpenAI-compatible server) and ``hasten serve-bench`` (its load generator)."""
from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import sys

from ..api import AUTOREGRESSIVE, check_method
from ..arguments import (
    UserError, add_draft_size_argument, at_least, add_model_arguments, add_runtime_arguments, apply_threads, checked_device,
    method_settings, resolve_dtype, torch_dtype,
)
from ..core import settings as settings_io
from ..drafters.base import REGISTRY
from .schema import DEFAULT_MAX_TOKENS

EXTRA = "pip install 'hasten[serve]'"
SERVER_MODULES = ("starlette", "uvicorn", "prometheus_client")
CLIENT_MODULES = ("openai",)
API_KEY_ENV = "HASTEN_API_KEY"


def require_extra(command: str, modules: tuple[str, ...]) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"hasten {command} needs {', '.join(missing)}, which the serve extra installs: {EXTRA}")


# ---- hasten serve ------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--method", default="prompt_lookup", choices=[AUTOREGRESSIVE, *sorted(REGISTRY)],
                        help="acceleration method (default prompt_lookup; autoregressive = plain decoding)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to all)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every route but /health "
                        f"(default: ${API_KEY_ENV}, else no key)")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the name clients pass as 'model' (default: the --model argument)")
    parser.add_argument("--max-batch", type=int, default=32, metavar="N",
                        help="rows decoded together at most; more requests wait their turn (default 32: a packed "
                        "batch costs little more per row than one row, and draft sizing drafts less as it fills)")
    parser.add_argument("--max-tokens-in-flight", type=int, default=None, metavar="N",
                        help="admit a request only while the running rows' prompts plus token budgets stay within N "
                        "(default: no limit but --max-batch)")
    parser.add_argument("--max-prefill-tokens", type=int, default=2048, metavar="N",
                        help="prompt tokens prefilled per decode step at most (one request always gets in): new "
                        "requests join a few per step, so a burst of long prompts does not stall running streams "
                        "(default 2048)")
    parser.add_argument("--kv-cache-mib", type=int, default=1024, metavar="N",
                        help="memory of the KV cache, allocated at start so the server's memory stays flat (default "
                        "1024). Requests wait while the running ones fill it; one that cannot fit alone is refused. "
                        "Room the running requests leave keeps finished ones' entries, copied for a later prompt that "
                        "starts the same way instead of prefilled again")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                        help="the most tokens a request that sets no max_tokens generates (a completion's default "
                        f"stays OpenAI's 16); GET /v1/models shows it (default {DEFAULT_MAX_TOKENS}: OpenAI's chat "
                        "default, the room left in the context, kept a CPU busy for minutes)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N",
                        help="largest request body accepted; larger ones get 413 (default 1 MiB)")
    parser.add_argument("--logprobs-mode", default="raw", choices=("raw", "processed"),
                        help="what logprobs report: the model's own log-probabilities (raw, vLLM's default) or "
                        "those of the law each token was drawn from, after the request's penalties, biases and "
                        "sampling transform (processed)")
    parser.add_argument("--pool", metavar="FILE",
                        help="with a method that learns across requests (lookahead, suffix): start from the pool "
                        "saved in FILE, where it exists, and save the pool there at exit (a corpus warms it too: "
                        "--method-arg corpus=TEXT_FILE)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                        help="uvicorn's log level (default warning; info logs every request)")
    parser.add_argument("--backend", default="torch", choices=("torch", "llama.cpp"),
                        help="torch (default) or llama.cpp: a .gguf target (and --draft) run by llama.cpp, each "
                        "request a llama.cpp sequence, all rows in one llama_batch per step (pip install "
                        "'hasten[llamacpp]'; docs/cpu.md)")
    add_runtime_arguments(parser)
    add_draft_size_argument(parser, None, ", or fixed for a request that samples with a seed, so a seed gives the "
                            "same text every run; auto sizes every row of a batch for the batch's rate, down to no "
                            "drafts on a busy server, where fixed drafts can cost more than they bring")


def run_serve(args: argparse.Namespace) -> int:
    require_extra("serve", SERVER_MODULES)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    at_least(args, 1, "max_batch", "max_tokens_in_flight", "max_prefill_tokens", "max_body_bytes",
             "default_max_tokens")
    at_least(args, 1, "kv_cache_mib")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty")
    settings_cls = getattr(REGISTRY.get(args.method), "Settings", None)
    method_kwargs = method_settings(args.method, settings_cls, args.method_arg)
    if method_kwargs:
        settings_io.build(settings_cls, **method_kwargs)  # a bad value fails before any model loads
    check_method(args.method, args.draft is not None)
    device = checked_device(args.device)
    apply_threads(args.threads)

    import uvicorn

    from ..api import load
    from .app import ServeOptions, create_app, scheduler_factory

    args.dtype, why = resolve_dtype(args.dtype, device, args.backend)
    if why:
        print(f"hasten serve: {why}", file=sys.stderr)
    if args.backend == "llama.cpp":
        if args.dtype != "float32" or device != "cpu":
            raise UserError("--backend llama.cpp runs the GGUF file's own quantisation on the CPU: "
                            "drop --dtype/--device")
        engine = load(args.model, args.method, draft=args.draft, backend="llama.cpp", draft_size=args.draft_size,
                      threads=args.threads, **method_kwargs)
    else:
        engine = load(args.model, args.method, draft=args.draft, device=device, dtype=torch_dtype(args.dtype),
                      draft_size=args.draft_size, threads=args.threads, **method_kwargs)
    # on llama.cpp the Scheduler's rows are sequences of one llama.cpp context (LlamaCppBatch)
    make_scheduler = scheduler_factory(engine, args.max_batch, args.max_tokens_in_flight, args.max_prefill_tokens,
                                       args.kv_cache_mib << 20)
    name = args.served_model_name or args.model
    options = ServeOptions(name, args.api_key, args.max_body_bytes, args.logprobs_mode, args.default_max_tokens,
                           pool_file=args.pool)
    try:
        app = create_app(engine, make_scheduler, options)
    except ValueError as err:  # --pool: a method without a pool, or a file that is not a saved pool
        raise UserError(f"--pool: {err}") from None
    if args.api_key is None and not is_loopback(args.host):
        print(f"hasten serve: warning: listening on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    print(f"hasten serve: model {name!r}, method {args.method}, max batch {args.max_batch}, "
          f"{args.default_max_tokens} tokens at most for a request that sets no max_tokens; "
          f"OpenAI API at http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- hasten serve-bench --------------------------------------------------------------------------
def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
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


def run_bench(args: argparse.Namespace) -> int:
    require_extra("serve-bench", CLIENT_MODULES)
    levels = concurrency_levels(args.concurrency)
    at_least(args, 1, "requests", "max_tokens", "num_prompts")
    at_least(args, 0, "warmup")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    from . import load

    prompts = load.prompts_from(args.prompts) if args.prompts else load.builtin_prompts(args.num_prompts)
    servers = load.servers_from(args.url or ["http://127.0.0.1:8000/v1"], args.api_key, args.model)
    results = load.run(servers, prompts, levels, args.requests, args.max_tokens, args.temperature, args.chat,
                       args.warmup)
    print(load.table(results))
    if args.out:
        load.write_json(results, args.out)
        print(f"hasten serve-bench: wrote {args.out}", file=sys.stderr)
    if args.chart:
        load.chart(results, args.chart)
        print(f"hasten serve-bench: drew {args.chart}", file=sys.stderr)
    return 0 if not any(level["errors"] for level in results["levels"]) else 1


COMMANDS = [
    ("serve", "serve a model with an acceleration method over an OpenAI-compatible HTTP API",
     add_serve_arguments, run_serve),
    ("serve-bench", "measure a running hasten serve (or any OpenAI-compatible server) under concurrent load",
     add_bench_arguments, run_bench),
]
