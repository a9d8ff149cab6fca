"""``hasten serve``: the OpenAI-compatible server (its load generator, ``hasten serve-bench``, is
:mod:`hasten.bench.serve_load_cli`)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from ..api import COPIED, DEFAULT_METHOD, check_method, method_names
from ..arguments import (
    API_KEY_ENV, UserError, add_draft_size_argument, at_least, add_model_arguments, add_runtime_arguments, apply_threads,
    checked_device, method_settings, require_serve_extra, resolve_dtype, torch_dtype,
)
from ..core import settings as settings_io
from ..drafters.base import REGISTRY
from .schema import DEFAULT_MAX_TOKENS

SERVER_MODULES = ("starlette", "uvicorn", "prometheus_client", "llguidance")  # llguidance: structured output and tools
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # longer prompts join in chunks: a step with 512 prompt tokens stalled 8 streams 0.8 s


# ---- hasten serve ------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--method", default=COPIED, choices=method_names(),
                        help=f"acceleration method (default {COPIED}: in a batch the mixed tree's trained drafter "
                             "drafts row by row, which at 8 clients cost more than it saved, docs/serve.md; "
                             f"'{DEFAULT_METHOD}' picks as hasten generate does; autoregressive = plain decoding)")
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
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                        help="tokens one decode step runs at most besides drafts, vLLM's name: one per decoding "
                        "request, then prompt tokens; a longer prompt is prefilled in chunks over several steps while "
                        "the running streams keep decoding (chunked prefill, the same numbers). At least --max-batch "
                        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS}, or --max-batch where that is more)")
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
    parser.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None, metavar="NAME",
                        help="how the model writes tool calls, read for tool_choice auto (the default with tools): "
                        "hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, and what hasten writes into the "
                        "system turn of a chat template that shows no tools) or llama3_json (Llama 3's JSON calls); "
                        "default: the one the chat template asks for")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool_choice auto is always on")
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
    require_serve_extra("serve", SERVER_MODULES)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    at_least(args, 1, "max_batch", "max_tokens_in_flight", "max_prefill_tokens", "max_body_bytes",
             "default_max_tokens")
    at_least(args, 1, "kv_cache_mib")
    at_least(args, args.max_batch, "max_num_batched_tokens")
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_batch)
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty")
    if args.method == DEFAULT_METHOD:
        check_method(args.method, has_draft=False, has_settings=bool(args.method_arg))  # settings need a method's name
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
        print(f"hasten serve: {why}; hasten.load's default is the same", file=sys.stderr)
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
                                       args.kv_cache_mib << 20, args.max_num_batched_tokens)
    name = args.served_model_name or args.model
    options = ServeOptions(name, args.api_key, args.max_body_bytes, args.logprobs_mode, args.default_max_tokens,
                           pool_file=args.pool, tool_call_parser=args.tool_call_parser)
    try:
        app = create_app(engine, make_scheduler, options)
    except ValueError as err:  # --pool: a method without a pool, or a file that is not a saved pool
        raise UserError(f"--pool: {err}") from None
    if args.api_key is None and not is_loopback(args.host):
        print(f"hasten serve: warning: listening on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    print(f"hasten serve: model {name!r}, method {engine.method}, max batch {args.max_batch}, "
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


COMMANDS = [
    ("serve", "serve a model with an acceleration method over an OpenAI-compatible HTTP API",
     add_serve_arguments, run_serve),
]
