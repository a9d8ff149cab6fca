"""Generators whose return value matters: a decode loop yields each step's tokens and returns why
it ended ("stop" or "length"), which a ``for`` loop would drop."""
from __future__ import annotations

from typing import Callable, Generator, TypeVar

Item, Mapped, Result = TypeVar("Item"), TypeVar("Mapped"), TypeVar("Result")


def consume(generator: Generator[Item, None, Result], each: Callable[[Item], object]) -> Result:
    """Call ``each`` on every item ``generator`` yields; returns what the generator returns."""
    while True:
        try:
            item = next(generator)
        except StopIteration as end:
            return end.value
        each(item)


def mapped(generator: Generator[Item, None, Result],
           function: Callable[[Item], Mapped]) -> Generator[Mapped, None, Result]:
    """``function`` of every item ``generator`` yields; returns what the generator returns."""
    while True:
        try:
            item = next(generator)
        except StopIteration as end:
            return end.value
        yield function(item)
