"""The ``hasten`` command: a thin layer over the library.

Each subcommand lives beside the code it drives and registers itself here through a
``(name, help, add_arguments, run)`` entry, so this file holds no method logic.
Errors a user can fix are printed as one line, with exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable

import torch

from .drafters.base import REGISTRY
from .engine.sampling import Sampling


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


class UserError(Exception):
    """An error caused by the command line's input; printed without a traceback."""


def methods() -> list[str]:
    from .api import AUTOREGRESSIVE

    return [AUTOREGRESSIVE, *sorted(REGISTRY)]


def parse_method_args(method: str, pairs: list[str]) -> dict:
    """``--method-arg num_tokens=8`` -> {"num_tokens": 8}, typed by the method's settings dataclass."""
    if not pairs:
        return {}
    settings_cls = getattr(REGISTRY.get(method), "Settings", None)
    if settings_cls is None:
        raise UserError(f"method {method!r} takes no --method-arg")
    fields = {f.name: f for f in dataclasses.fields(settings_cls)}
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in fields:
            raise UserError(f"--method-arg {pair!r}: expected KEY=VALUE with KEY in {sorted(fields)}")
        default = fields[key].default
        if isinstance(default, bool):
            out[key] = value.lower() in ("1", "true", "yes", "on")
        elif isinstance(default, (int, float)):
            try:
                out[key] = type(default)(value)
            except ValueError:
                raise UserError(f"--method-arg {key}: {value!r} is not a {type(default).__name__}") from None
        else:
            out[key] = value
    return out


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="zoo name (zoo:code-tiny), local directory or hub id")
    parser.add_argument("--draft", help="draft model for --method draft_model (zoo name or directory)")
    parser.add_argument(
        "--method-arg", action="append", default=[], metavar="KEY=VALUE",
        help="a setting of the method, e.g. num_tokens=8 (repeatable)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")


# ---- hasten generate -------------------------------------------------------------------
def _add_generate(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument(
        "--method", default="prompt_lookup", choices=methods(),
        help="acceleration method (default prompt_lookup; autoregressive = plain decoding)",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-file", help="file holding the prompt text")
    add_sampling_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def _run_generate(args: argparse.Namespace) -> int:
    from .api import load

    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except OSError as err:
            raise UserError(f"--prompt-file: {err.strerror}: {args.prompt_file}") from None
    # Check what is cheap to check before spending seconds on loading models.
    if not prompt:
        raise UserError("prompt is empty")
    Sampling(args.temperature, args.top_k, args.top_p)
    if args.max_new_tokens < 0:
        raise UserError(f"max_new_tokens must be >= 0, got {args.max_new_tokens}")
    method_kwargs = parse_method_args(args.method, args.method_arg)
    engine = load(args.model, args.method, draft=args.draft, **method_kwargs)
    options = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
    )
    if args.json:
        out = engine.generate(prompt, **options)
        record = {"model": args.model, "method": args.method, "text": out.text, "token_ids": out.token_ids}
        print(json.dumps({**record, "stats": out.stats.to_dict()}))
        return 0
    from .engine.stats import DecodeStats

    stats = DecodeStats()
    for piece, _ in engine.steps(prompt, stats, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(
        f"[{args.method}] tau {stats.mean_accepted:.2f} | {stats.tokens_per_second:.1f} tok/s | "
        f"{stats.steps} steps | {stats.new_tokens} tokens",
        file=sys.stderr,
    )
    return 0


Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: list[Command] = [("generate", "generate text with an acceleration method", _add_generate, _run_generate)]


def _extra_commands() -> list[Command]:
    """Subcommands defined beside the code they drive."""
    found = []
    for module in ("hasten.bench.cli", "hasten.training.cli", "hasten.diffusion.cli"):
        try:
            found.extend(__import__(module, fromlist=["COMMANDS"]).COMMANDS)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return found


def quiet_transformers() -> None:
    """Our own progress bars and messages are enough on a terminal."""
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hasten", description="Lossless acceleration of generative models.")
    subs = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, help_text, add, run in COMMANDS + _extra_commands():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        add(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_grad_enabled(False)
    quiet_transformers()
    try:
        return args.run(args)
    except (UserError, ValueError, TypeError, FileNotFoundError) as err:
        print(f"hasten: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
