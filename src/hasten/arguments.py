"""What every ``hasten`` subcommand shares: its argument parser, its user error, the model
and sampling flags, the output-folder check and the one-line warning format.

It sits on a low floor (it imports only :mod:`hasten.core`), so the subcommands that live
beside the code they drive (``bench``, ``train``, ``diffusion``) import it, and the
top-level :mod:`hasten.cli` imports them, with no circle.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

from .core import settings as settings_io

PACKAGE_DIR = Path(__file__).resolve().parent


class UserError(Exception):
    """An error caused by the command line's input; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_arguments(parser: argparse.ArgumentParser, per_method: bool = False) -> None:
    """--model, --draft and --method-arg KEY=VALUE (``per_method``: also METHOD.KEY=VALUE)."""
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="zoo name (zoo:code-tiny), local directory or hub id")
    parser.add_argument("--draft", metavar="PATH",
                        help="draft model for methods that need one, such as draft_model (zoo name or directory)")
    example = "num_tokens=8" + (", or prompt_lookup.num_tokens=8 for one method" if per_method else "")
    parser.add_argument("--method-arg", action="append", default=[], metavar="KEY=VALUE",
                        help=f"a setting of the method, e.g. {example} (repeatable)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only")
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass in (0, 1]")
    parser.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def method_settings(method: str, settings_cls: type | None, pairs: list[str]) -> dict:
    """``--method-arg num_tokens=8`` -> {"num_tokens": 8}, typed by the method's settings dataclass."""
    if not pairs:
        return {}
    if settings_cls is None:
        raise UserError(f"method {method!r} takes no --method-arg")
    return settings_io.from_pairs(settings_cls, pairs)


def writable_directory(path: str | Path, flag: str = "--out") -> Path:
    """The output folder, created if missing and proven writable before any work starts
    (a run that ends by failing to save its results has wasted its time)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write there ({err.strerror or err})") from None
    return path


def one_line(text: object) -> str:
    """A message on one line (a terminal user reads the first line only)."""
    return " ".join(str(text).split())


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A ``warnings.showwarning`` for terminal users: ``hasten: warning: ...`` on one line,
    without the source line; a warning from outside hasten keeps its category's name."""
    text = one_line(message)
    if not Path(filename).resolve().is_relative_to(PACKAGE_DIR):
        text = f"{category.__name__}: {text}"
    print(f"hasten: warning: {text}", file=file or sys.stderr)


@contextlib.contextmanager
def readable_warnings() -> Iterator[None]:
    """Show warnings with :func:`show_warning` inside the block; the previous way after it."""
    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        yield
