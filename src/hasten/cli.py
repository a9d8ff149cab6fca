"""The ``hasten`` command: a thin layer over the library.

Each subcommand lives beside the code it drives and offers a ``(name, help, add_arguments,
run)`` entry in its module's ``COMMANDS``, so this file holds no method logic. What the
subcommands share (parser, flags, :class:`UserError`) is in :mod:`hasten.arguments`.
Errors a user can fix are printed as one line, with exit status 2; warnings as one line too.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch

from .api import DEFAULT_METHOD, METHOD_HELP, check_method, load, method_names
from .arguments import (
    Parser, UserError, add_draft_size_argument, add_model_arguments, add_runtime_arguments, add_sampling_arguments,
    apply_threads, at_least, checked_device, counted, method_settings, note_unused_sampling, one_line, readable_warnings,
    resolve_dtype,
    torch_dtype,
)
from .bench import cli as bench_cli
from .bench import replay_cli
from .bench import serve_load_cli
from .bench import structured as structured_bench
from .bench import vlm as vlm_bench
from .core import settings as settings_io
from .core.constraint import ConstraintError
from .core.sampling import Sampling
from .diffusion import cli as diffusion_cli
from .dlm import cli as dlm_cli
from .export import cli as export_cli
from .drafters.base import REGISTRY
from .engine.sizing import default_size
from .serve import cli as serve_cli
from .training import cli as training_cli
from .version import __version__

# Errors the user can fix from the command line: one line, exit status 2, no traceback.
USER_ERRORS = (UserError, ValueError, TypeError, ImportError, FileNotFoundError, FileExistsError, IsADirectoryError,
               NotADirectoryError, PermissionError)


def checked_method_settings(method: str, pairs: list[str]) -> dict:
    """``--method-arg`` values typed and range-checked by the method's settings dataclass,
    so a bad value fails before any model is loaded."""
    if method == DEFAULT_METHOD:
        check_method(method, has_draft=False, has_settings=bool(pairs))  # settings need a method's name
    settings_cls = REGISTRY[method].Settings if method in REGISTRY else None
    values = method_settings(method, settings_cls, pairs)
    if values:
        settings_io.build(settings_cls, **values)
    return values


# ---- hasten generate -------------------------------------------------------------------
def _add_generate(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--method", default=DEFAULT_METHOD, choices=method_names(),
        help=METHOD_HELP,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", metavar="PATH", help="file holding the prompt text (- reads standard input)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as one user message through the model's chat template")
    parser.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the prompt")
    parser.add_argument("--image", action="append", default=[], metavar="PATH",
                        help="image file for a vision-language model (repeatable); the prompt gets one image "
                             "token per image in front unless it holds them (with --chat: image entries in front "
                             "of the user turn's text, through the processor's chat template)")
    add_sampling_arguments(parser)
    rules = parser.add_argument_group("distribution transforms (as vLLM's; lossless under speculation)")
    rules.add_argument("--min-p", type=float, default=None, help="drop tokens below MIN_P times the best one's "
                       "probability, in [0, 1] (sampling)")
    rules.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="> 0; prompt and generated tokens: positive logits / R, negative * R (default 1: none)")
    rules.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtracted once from each token generated so far (default 0)")
    rules.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtracted per occurrence among the generated tokens (default 0)")
    rules.add_argument("--min-tokens", type=int, default=0, help="EOS is held back until this many tokens (default 0)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop string (repeatable): generation ends at it and the text stops before it; "
                             r"\n and \t are read as newline and tab")
    structured = parser.add_argument_group(
        "structured output (pip install 'hasten[structured]'; the text is plain constrained decoding's, "
        "token for token, with any method)").add_mutually_exclusive_group()
    structured.add_argument("--json-object", action="store_true", help="the text is one JSON object")
    structured.add_argument("--json-schema", metavar="FILE", help="the text is JSON valid under the schema in FILE")
    structured.add_argument("--regex", metavar="R", help="the text matches the regular expression R")
    structured.add_argument("--choice", metavar="A,B,...", help="the text is one of the comma-separated strings")
    structured.add_argument("--grammar", metavar="FILE", help="the text follows the grammar in FILE (Lark or GBNF)")
    add_runtime_arguments(parser)
    parser.add_argument("--backend", default="torch", choices=("torch", "llama.cpp"),
                        help="torch (default) or llama.cpp: a .gguf target (and --draft) run by llama.cpp, "
                             "hasten's drafters and verifier on top (pip install 'hasten[llamacpp]'; docs/cpu.md)")
    add_draft_size_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("--pool", metavar="FILE",
                        help="with a method that learns across requests (lookahead, suffix): draft from the pool "
                        "saved in FILE, where it exists, and save the pool with this generation's text there")


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt
    try:
        if args.prompt_file == "-":
            return sys.stdin.read()
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--prompt-file {args.prompt_file}: {getattr(err, 'strerror', None) or err}") from None


def _constraint(args: argparse.Namespace):
    """The structured-output spec the flags ask for (None: free text); checked before any model loads."""
    from .structured import Choice, Grammar, JsonSchema, Regex

    def read(path: str, flag: str) -> str:
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{flag} {path}: {getattr(err, 'strerror', None) or err}") from None

    asked = [(flag, make) for flag, value, make in (
        ("--json-object", args.json_object, lambda: JsonSchema()),
        ("--json-schema", args.json_schema, lambda: JsonSchema(read(args.json_schema, "--json-schema"))),
        ("--regex", args.regex, lambda: Regex(args.regex)),
        ("--choice", args.choice, lambda: Choice([option for option in args.choice.split(",")])),
        ("--grammar", args.grammar, lambda: Grammar(read(args.grammar, "--grammar"))),
    ) if value]
    if not asked:
        return None
    flag, make = asked[0]
    try:
        spec = make()
        spec.validate()
    except ConstraintError as err:
        raise UserError(f"{flag}: {err}") from None
    return spec


def _messages(args: argparse.Namespace, prompt: str) -> list[dict]:
    """--chat: the prompt as one user turn, after the --system message if one is given;
    with --image, the turn's content is one image entry per image, then the prompt (the
    processor's chat template writes the image tokens)."""
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    content = [*[{"type": "image"} for _ in args.image], {"type": "text", "text": prompt}] if args.image else prompt
    return [*system, {"role": "user", "content": content}]


def _run_generate(args: argparse.Namespace) -> int:
    # Check what is cheap to check before spending seconds on loading models.
    prompt = _read_prompt(args)
    if not prompt:
        raise UserError("prompt is empty")
    if args.system is not None and not args.chat:
        raise UserError("--system needs --chat (a system message is part of a chat)")
    rules = dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                 frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens)
    Sampling(args.temperature, args.top_k, args.top_p, **rules)
    constraint = _constraint(args)
    note_unused_sampling(args)
    at_least(args, 1, "max_new_tokens")  # as the server refuses max_tokens 0: nothing to generate
    method_kwargs = checked_method_settings(args.method, args.method_arg)
    check_method(args.method, args.draft is not None)
    device = checked_device(args.device)
    threads = apply_threads(args.threads)
    if args.backend == "llama.cpp" and (args.dtype not in ("float32", "auto") or device != "cpu"):
        raise UserError("--backend llama.cpp runs the GGUF file's own quantisation on the CPU: drop --dtype/--device")
    args.dtype, why = resolve_dtype(args.dtype, device, args.backend)
    if why:
        print(f"hasten: {why}; hasten.load's default is the same", file=sys.stderr)
    runtime_args = dict(device=device, dtype=torch_dtype(args.dtype)) if args.backend == "torch" else {}
    engine = load(args.model, args.method, draft=args.draft, backend=args.backend, **runtime_args,
                  draft_size=args.draft_size, threads=args.threads, **method_kwargs)
    inputs = prompt
    if args.chat:  # the images go into the chat's messages, and the encoded chat carries them
        messages = _messages(args, prompt)
        inputs = engine.encode_chat_images(messages, args.image) if args.image else engine.encode_chat(messages)
    options = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        stop=[text.replace("\\n", "\n").replace("\\t", "\t") for text in args.stop],
        images=(args.image or None) if not args.chat else None, constraint=constraint, **rules,
    )
    pool = None
    if args.pool is not None:
        try:
            pool = engine.open_pool(args.pool)
        except ValueError as err:  # a method without a pool, or a file that is not a saved pool
            raise UserError(f"--pool: {err}") from None

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        out = engine.collect(inputs, on_piece=None if args.json else show, **options)
    except ConstraintError as err:  # a constraint that does not compile, or conflicts with the other flags
        raise UserError(str(err)) from None
    stats = out.stats
    if pool is not None:
        pool.save(args.pool)
    if args.json:
        # finish_reason as the server names it: "stop" (EOS or a stop string) or "length"
        record = {"model": args.model, "method": engine.method, "chat": args.chat, "images": args.image,
                  "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}
        draft_size = default_size(args.draft_size, args.temperature > 0, args.seed is not None)
        runtime = {"device": device, "dtype": args.dtype, "threads": threads, "draft_size": draft_size,
                   "backend": args.backend}
        print(json.dumps({**record, **runtime, "stats": stats.to_dict()}))
        return 0
    sys.stdout.write("\n")
    print(
        f"[{engine.method}] tau {stats.mean_accepted:.2f} | {stats.tokens_per_second:.1f} tok/s | "
        f"{counted(stats.steps, 'step')} | {counted(stats.new_tokens, 'token')} | {counted(threads, 'thread')}"
        + (f" | forced {stats.forced_share:.0%}" if constraint is not None else ""),
        file=sys.stderr,
    )
    return 0


Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: list[Command] = [
    ("generate", "generate text with an acceleration method", _add_generate, _run_generate),
    *bench_cli.COMMANDS,
    *replay_cli.COMMANDS,
    *structured_bench.COMMANDS,
    *training_cli.COMMANDS,
    *diffusion_cli.COMMANDS,
    *dlm_cli.COMMANDS,
    *vlm_bench.COMMANDS,
    *serve_cli.COMMANDS,
    *serve_load_cli.COMMANDS,
    *export_cli.COMMANDS,
]


def quiet_transformers() -> None:
    """Our own progress bars and messages are enough on a terminal."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="hasten", description="Lossless acceleration of generative models.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subs = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, help_text, add, run in COMMANDS:
        sub = subs.add_parser(name, help=help_text, description=help_text)
        add(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    with readable_warnings():
        args = build_parser().parse_args(argv)
        quiet_transformers()
        try:
            with torch.no_grad():
                return args.run(args)
        except USER_ERRORS as err:
            print(f"hasten: error: {one_line(err)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(main())
