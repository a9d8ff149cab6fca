"""How many CPU threads torch computes with: the one rule for the library and the CLI.

One thread is the default everywhere: on a shared CPU, torch's default of a thread per core is
many times slower whenever anything else runs, and one thread is never the slow case on a busy
machine (the measurements: docs/cpu.md, "The measurements behind the code's choices"); ``0``
takes every core (worth it on a large model and an idle machine).

torch's thread count is the process's, so the library sets it only while it computes
(:func:`using_threads`) and gives the caller's back between steps; the CLI owns its process and
sets it once (:func:`set_threads`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Generator, Iterator, TypeVar

import torch

from .errors import FieldError

DEFAULT_THREADS = 1
Item = TypeVar("Item")


def thread_count(threads: int | None) -> int | None:
    """``threads`` checked: the count it means (0: one per core), or None (leave torch's as it is)."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise FieldError("threads", "invalid_value",
                         f"{{field}} must be >= 0 (an integer; 0 = all cores), got {threads!r}")
    return threads or os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    """Give torch ``threads`` threads for the rest of the process; returns the number it has."""
    count = thread_count(threads)
    if count is not None:
        torch.set_num_threads(count)
    return torch.get_num_threads()


@contextlib.contextmanager
def using_threads(threads: int | None) -> Iterator[None]:
    """torch on ``threads`` threads inside the block, on the caller's count again after it."""
    count = thread_count(threads)
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stepped_in_threads(steps: Generator[Item, None, object], threads: int | None) -> Generator[Item, None, object]:
    """``steps`` with each step computed on ``threads`` threads; the caller's code between steps
    (a stream's consumer) runs on the caller's count. Returns what ``steps`` returns."""
    count = thread_count(threads)  # checked now, not at the first step
    while True:
        with using_threads(count):
            try:
                item = next(steps)
            except StopIteration as end:
                return end.value
        yield item
