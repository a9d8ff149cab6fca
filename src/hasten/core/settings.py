"""One converter between settings dataclasses and the outside world.

Every method's knobs live in one frozen dataclass (defaults there and nowhere else).
This module reads those dataclasses' type hints to

* check values in ``__post_init__`` with one rule set (:class:`Settings`, :func:`check_types`):
  an ``int`` field takes an int and never a bool, a ``float`` field takes an int or a finite
  float, a ``bool`` field only True or False, ``X | None`` also takes None;
* turn command-line text into typed values (:func:`parse_value`, :func:`from_pairs` for
  ``--method-arg KEY=VALUE``);
* make one argparse flag per field (:func:`add_flags`, :func:`from_args`), for
  ``hasten generate``, ``hasten bench``, ``hasten train`` and the server.

A field whose hint is not one of those scalars (tree paths, ...) receives command-line
text as it is and its dataclass parses it in ``__post_init__``. A field's help text is
``metadata={"help": ...}`` (see :func:`option`).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_NONE = ("none", "null")
_WHAT = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", Path: "a path"}


def option(default, help: str):
    """A settings field whose help text the command line shows."""
    return dataclasses.field(default=default, metadata={"help": help})


def _scalar_kind(members: list) -> type | None:
    """The one scalar type a field's hint (None removed) stands for, or None for anything else."""
    kinds = set(members)
    if len(kinds) == 1 and members[0] in _WHAT:
        return members[0]
    if kinds == {int, float}:
        return float
    if kinds == {str, Path}:
        return str
    return None


@lru_cache(maxsize=None)
def field_kinds(settings_cls: type) -> dict[str, tuple[type | None, bool]]:
    """name -> (scalar type, or None for a field that parses itself; whether None is allowed)."""
    hints = typing.get_type_hints(settings_cls)
    out = {}
    for field in dataclasses.fields(settings_cls):
        hint = hints[field.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        members = list(typing.get_args(hint)) if union else [hint]
        optional = type(None) in members
        out[field.name] = (_scalar_kind([m for m in members if m is not type(None)]), optional)
    return out


def _type_error(settings_cls: type, name: str, kind: type, value: Any) -> ValueError:
    return ValueError(f"{settings_cls.__name__}.{name} must be {_WHAT[kind]}, got {value!r}")


def _fits(kind: type, value: Any) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, (str, Path))


def check_types(settings: Any) -> None:
    """Raise ValueError naming the first field whose value does not fit its type hint."""
    cls = type(settings)
    for name, (kind, optional) in field_kinds(cls).items():
        value = getattr(settings, name)
        if kind is None or (value is None and optional):
            continue
        if not _fits(kind, value):
            raise _type_error(cls, name, kind, value)


class Settings:
    """Base of every settings dataclass: ``__post_init__`` checks field types from the
    hints; subclasses call ``super().__post_init__()`` before their own range checks."""

    def __post_init__(self) -> None:
        check_types(self)


def parse_value(settings_cls: type, name: str, text: str) -> Any:
    """Command-line text -> the field's type (ValueError naming the field if it does not parse).
    ``none`` or ``null`` is None for a field that allows None."""
    kinds = field_kinds(settings_cls)
    if name not in kinds:
        raise ValueError(f"{settings_cls.__name__} has no setting {name!r}; known: {', '.join(sorted(kinds))}")
    kind, optional = kinds[name]
    word = text.strip().lower()
    if optional and word in _NONE:
        return None
    if kind is bool:
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise _type_error(settings_cls, name, bool, text)
    if kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            raise _type_error(settings_cls, name, kind, text) from None
        if not _fits(kind, value):  # nan, inf
            raise _type_error(settings_cls, name, kind, text)
        return value
    if kind is Path:
        return Path(text)
    return text


def from_pairs(settings_cls: type, pairs: list[str], flag: str = "--method-arg") -> dict:
    """``["num_tokens=8", "adaptive=true"]`` -> {"num_tokens": 8, "adaptive": True}."""
    out = {}
    known = ", ".join(sorted(field_kinds(settings_cls)))
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"{flag} {pair!r}: expected KEY=VALUE with KEY one of: {known}")
        if key not in field_kinds(settings_cls):
            raise ValueError(f"{flag} {pair!r}: no setting {key!r} (expected KEY=VALUE with KEY one of: {known})")
        out[key] = parse_value(settings_cls, key, text)
    return out


def build(settings_cls: type, settings: Any = None, **kwargs) -> Any:
    """A ready settings object, or one built from its fields as keyword arguments."""
    if settings is not None:
        if kwargs:
            raise TypeError(f"pass either settings= or keyword settings, not both ({sorted(kwargs)})")
        if not isinstance(settings, settings_cls):
            raise TypeError(f"settings must be a {settings_cls.__name__}, got {type(settings).__name__}")
        return settings
    known = field_kinds(settings_cls)
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise TypeError(f"{settings_cls.__name__} has no setting(s) {unknown}; known: {', '.join(sorted(known))}")
    return settings_cls(**kwargs)


def flag_name(name: str) -> str:
    """``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


def add_flags(group, settings_cls: type, added: set[str] | None = None) -> None:
    """One flag per field: ``batch_size`` -> ``--batch-size``; booleans get ``--no-...``.
    Defaults are SUPPRESSed so only flags given reach the dataclass (its defaults rule).
    A name already in ``added`` is skipped (one flag sets every dataclass that has it)."""
    added = set() if added is None else added
    for field in dataclasses.fields(settings_cls):
        if field.name in added:
            continue
        added.add(field.name)
        kind, optional = field_kinds(settings_cls)[field.name]
        default = "unset" if field.default is None else field.default
        help_text = f"{field.metadata.get('help', '')} (default: {default})".strip().replace("%", "%%")
        if kind is bool:
            group.add_argument(flag_name(field.name), action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
            continue

        def convert(text: str, name=field.name):
            try:
                return parse_value(settings_cls, name, text)
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None

        metavar = field.name.upper() if kind in (str, Path, None) else kind.__name__.upper()
        group.add_argument(flag_name(field.name), type=convert, default=argparse.SUPPRESS, metavar=metavar,
                           help=help_text + (" ('none' unsets it)" if optional and field.default is not None else ""))


def from_args(settings_cls: type, args: argparse.Namespace) -> Any:
    """The dataclass built from the flags :func:`add_flags` made (absent flags: defaults)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(settings_cls) if hasattr(args, f.name)}
    return settings_cls(**given)
