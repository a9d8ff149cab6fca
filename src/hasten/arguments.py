"""What every ``hasten`` subcommand shares: its argument parser, its user error, the model,
sampling and runtime (device, dtype, threads) flags, the output-folder check and the
one-line warning format.

It sits on a low floor (of hasten it imports only :mod:`hasten.core`), so the subcommands
that live beside the code they drive (``bench``, ``train``, ``diffusion``) import it, and
the top-level :mod:`hasten.cli` imports them, with no circle.
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

import torch

from .core import settings as settings_io
from .core.errors import FieldError, HastenWarning
from .core.threads import DEFAULT_THREADS, set_threads
from .core.cpu import native_bfloat16


class UserError(Exception):
    """An error caused by the command line's input; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_model_arguments(parser: argparse.ArgumentParser, per_method: bool = False) -> None:
    """--model, --draft and --method-arg KEY=VALUE (``per_method``: also METHOD.KEY=VALUE)."""
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="zoo name (zoo:smollm2-135m after `make real`; zoo:code-tiny is a toy for tests), a "
                        ".gguf file or a directory holding one, a local Hugging Face directory, or a hub id")
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


# Flags that only shape sampling: with temperature 0 decoding is greedy and they change nothing.
SAMPLING_ONLY = ("top_k", "top_p", "min_p", "seed")


def note_unused_sampling(args: argparse.Namespace) -> None:
    """One line naming the sampling flags given without a temperature (they would be ignored in silence)."""
    unused = [f"--{name.replace('_', '-')}" for name in SAMPLING_ONLY if getattr(args, name, None) is not None]
    if unused and args.temperature == 0:
        warnings.warn(f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without --temperature "
                      "> 0: decoding is greedy", HastenWarning, stacklevel=2)


SERVE_EXTRA = "pip install 'hasten[serve]'"  # hasten serve's HTTP modules and serve-bench's client
API_KEY_ENV = "HASTEN_API_KEY"  # the key hasten serve asks for and serve-bench sends, where --api-key is not given


def require_serve_extra(command: str, modules: tuple[str, ...]) -> None:
    """UserError naming the ``modules`` that ``hasten COMMAND`` needs and this environment lacks."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"hasten {command} needs {', '.join(missing)}, which the serve extra installs: {SERVE_EXTRA}")


def at_least(args: argparse.Namespace, low: int, *flags: str) -> None:
    """UserError naming the first of ``flags`` (argparse dest names) set below ``low``."""
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < low:
            raise UserError(f"--{flag.replace('_', '-')} must be >= {low}, got {value}")


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


def counted(count: int, noun: str) -> str:
    """"1 thread", "2 threads": a count and its noun in terminal lines."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def one_line(text: object) -> str:
    """A message on one line (a terminal user reads the first line only)."""
    return " ".join(str(text).split())


def warning_origin(filename: str, lineno: int) -> str:
    """Where a warning was raised, as a user would look it up: ``transformers/utils/x.py:12``
    for an installed package (the path below its ``sys.path`` entry), else the file's path."""
    path = Path(filename).resolve()
    roots = [Path(entry).resolve() for entry in sys.path if entry]
    root = max((r for r in roots if path.is_relative_to(r)), key=lambda r: len(r.parts), default=None)
    return f"{path.relative_to(root) if root is not None else path}:{lineno}"


class WarningPrinter:
    """A ``warnings.showwarning`` for terminal users. hasten's own warnings
    (:class:`~hasten.core.errors.HastenWarning`) read ``hasten: warning: ...`` on one line; a
    dependency's pass through once per message, with their category and origin, so they are
    never mistaken for hasten's."""

    def __init__(self) -> None:
        self.shown: set[tuple[type, str]] = set()

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        text = one_line(message)
        if (category, text) in self.shown:
            return
        self.shown.add((category, text))
        if issubclass(category, HastenWarning):
            print(f"hasten: warning: {text}", file=file or sys.stderr)
        else:
            print(f"{category.__name__} from {warning_origin(filename, lineno)}: {text}", file=file or sys.stderr)


@contextlib.contextmanager
def readable_warnings() -> Iterator[None]:
    """Show warnings with a :class:`WarningPrinter` inside the block; the previous way after it."""
    with warnings.catch_warnings():
        warnings.showwarning = WarningPrinter()
        yield


# ---- where and how the model runs: --device, --dtype, --threads ------------------------------
DTYPES = ("float32", "float16", "bfloat16", "int8")  # int8: int8 linear layers on the CPU (docs/cpu.md)
AUTO_DTYPE = "auto"
DTYPE_CONTRACT = ("on the CPU, in every dtype, speculative output equals hasten's plain decoding token for token; "
                  "equal to Hugging Face generate's: float32 only (docs/fidelity.md, 'Precision')")


def add_runtime_arguments(parser: argparse.ArgumentParser, auto_dtype: bool = True) -> None:
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu (default), cuda, cuda:N or mps")
    if auto_dtype:
        parser.add_argument("--dtype", default=AUTO_DTYPE, choices=(AUTO_DTYPE, *DTYPES),
                            help="dtype of the weights; auto (default): bfloat16 on a CPU with native bfloat16 "
                            "instructions (AMX or AVX512-BF16, as vLLM's CPU build picks), else float32. "
                            + DTYPE_CONTRACT)
    else:
        parser.add_argument("--dtype", default="float32", choices=DTYPES,
                            help="dtype of the weights (default float32). " + DTYPE_CONTRACT)
    add_threads_argument(parser)


def resolve_dtype(name: str, device: str, backend: str = "torch") -> tuple[str, str | None]:
    """``--dtype`` with ``auto`` decided: (dtype name, the one line saying why where auto picked
    other than float32, else None). llama.cpp runs the file's own quantisation: float32 stands
    for "as is"."""
    if name != AUTO_DTYPE:
        return name, None
    if backend != "torch":
        return "float32", None
    if not device.startswith("cpu"):  # on a GPU hasten guarantees float32's tokens today (docs/fidelity.md)
        return "float32", None
    native = native_bfloat16()
    if native:
        return "bfloat16", (f"dtype bfloat16 (auto: this CPU has native bfloat16 instructions, {native}; output "
                            "equals hasten's plain decoding in bfloat16; --dtype float32 for Hugging Face "
                            "generate's exact tokens)")
    return "float32", None  # what it always was: nothing to say


def add_threads_argument(parser: argparse.ArgumentParser, what: str = "CPU threads for torch") -> None:
    """--threads, with the library's default and its reason (hasten.core.threads)."""
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                        help=f"{what} (default {DEFAULT_THREADS}: on a busy machine torch's default of one per core "
                        "was 4-10x slower; 0 = all cores)")


def checked_device(name: str) -> str:
    """``--device`` checked before any model loads: one line saying why it cannot be used."""
    match = re.fullmatch(r"(cpu|mps|cuda)(?::(\d+))?", name)
    if match is None or (match[2] is not None and match[1] != "cuda"):
        raise UserError(f"--device {name}: unknown device; use cpu, cuda, cuda:N or mps")
    kind, index = match[1], match[2]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {name}: CUDA is not available here (no NVIDIA GPU, or a CPU-only torch); "
                            "use --device cpu")
        count = torch.cuda.device_count()
        if index is not None and int(index) >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA device(s), cuda:0 .. cuda:{count - 1}")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: Apple's MPS backend is not available here; use --device cpu")
    return name


def torch_dtype(name: str):
    """``--dtype`` name -> torch dtype, or "int8", which hasten.load quantizes to (argparse
    already limited it to :data:`DTYPES`)."""
    return name if name == "int8" else getattr(torch, name)


def apply_threads(threads: int) -> int:
    """Give torch ``threads`` CPU threads for the command's process (0: one per core); returns the
    number it got. The library's rule (hasten.core.threads), in the flag's words."""
    try:
        return set_threads(threads)
    except FieldError as err:
        raise UserError(err.render("--threads")) from None


# ---- how deep drafts go: --draft-size ----------------------------------------------------------
DRAFT_SIZES = ("auto", "fixed")
DEFAULT_DRAFT_SIZE = "auto"


def add_draft_size_argument(parser: argparse.ArgumentParser, default: str | None = None,
                            why: str = ", or fixed when sampling with --seed, so a seed gives the same text every run") -> None:
    parser.add_argument(
        "--draft-size", default=default, choices=DRAFT_SIZES,
        help="fixed: each method drafts as deep as its settings say; auto: each step's depth is chosen "
        "from this machine's measured forward cost (PyTorch's or llama.cpp's, calibrated once, cached under "
        "$HASTEN_CACHE/cost) "
        f"and the method's measured acceptance, for a whole batch at once (default {default or 'auto'}{why})",
    )
