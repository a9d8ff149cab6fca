"""The pool contract: what drafters that learn across requests share, and what the engine and the
server see of it (``Engine.pool``, ``--pool FILE``, ``/metrics``): a *pool* of text they have
seen, its counters, and one file format to save and load it. Each pool's own structure sits beside
its drafter (:mod:`hasten.drafters.lookahead_pool`, :mod:`hasten.drafters.suffix_pool`).

A pooled drafter (``lookahead``, ``suffix``) keeps its pool on the drafter object, so every
generation that drafts with that object (an :class:`~hasten.api.Engine`'s, every row of
``hasten serve``) reads what the others wrote. A pool is safe to use from several threads:
each public method holds the pool's lock. A generation that opts out (``DraftContext.use_pool``
False, the server's ``"pool": false``) drafts from a private pool of its own instead, so it
neither reads the shared pool nor writes to it.

Pools never save a prompt: what a file holds is generated text (and any corpus fed to the pool).
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

FORMAT = "hasten-pool"  # every pool file's "format"; "kind" names the drafter whose pool it is


@dataclass(frozen=True)
class PoolStats:
    """A pool's size and how often it drafted (for ``/metrics``)."""

    entries: int  # what the pool's memory bound counts: trie nodes (lookahead), cached tokens (suffix)
    requests: int  # generations whose text the pool holds, as far as it counts them
    lookups: int  # draft steps that asked the pool
    hits: int  # ... and got a draft from text the pool learned (see each drafter's docs)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class Pool:
    """Base of the shared pools: a lock, hit counters, and the file round trip. Subclasses
    name their ``kind`` and implement the generations' lifecycle (:meth:`start`, :meth:`extend`,
    :meth:`end`, :meth:`feed`, :meth:`learn`: what :class:`~hasten.drafters.pooled.PooledDrafter`
    calls), :meth:`to_json`, :meth:`from_json` and :meth:`stats`."""

    kind: str

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.lookups = 0
        self.hits = 0

    def count(self, hit: bool) -> None:
        """One draft step asked the pool; ``hit``: its draft came from learned text."""
        self.lookups += 1
        self.hits += hit

    def start(self, prompt: list[int], fed: int):
        """A generation begins with ``prompt``; ``fed``: tokens of its sequence already accounted
        for. Returns its place in the pool, which the calls below take."""
        raise NotImplementedError

    def extend(self, place, tokens: list[int]) -> None:
        """The generation's sequence is now ``tokens``."""
        raise NotImplementedError

    def end(self, place) -> None:
        """The generation ended: its prompt is forgotten, its output kept."""
        raise NotImplementedError

    def feed(self, tokens: list[int]) -> None:
        """A document to learn as if it were generated (a corpus)."""
        raise NotImplementedError

    def learn(self, output: list[int]) -> None:
        """A finished generation's output, from a generation that drafted from a pool of its own."""
        raise NotImplementedError

    def stats(self) -> PoolStats:
        raise NotImplementedError

    def to_json(self) -> dict:
        """What :meth:`save` writes beside ``format`` and ``kind``."""
        raise NotImplementedError

    def from_json(self, data: dict) -> None:
        """Replace this pool's content by a saved one (refusing one saved with other settings)."""
        raise NotImplementedError

    def save(self, path: str | Path) -> None:
        """Write the pool to ``path`` as JSON, atomically (a crash never leaves half a file)."""
        path = Path(path)
        with self.lock:
            data = {"format": FORMAT, "kind": self.kind, **self.to_json()}
        fd, temp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent or Path("."))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, separators=(",", ":"))
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def load(self, path: str | Path) -> None:
        """Replace the pool's content by the one saved at ``path`` (ValueError if it is not
        a pool of this kind)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as err:
            raise ValueError(f"pool file {str(path)!r}: {err.strerror}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"pool file {str(path)!r} is not a saved pool (not JSON: {err.msg})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"pool file {str(path)!r} is not a saved hasten pool")
        if data.get("kind") != self.kind:
            raise ValueError(f"pool file {str(path)!r} holds a {data.get('kind')} pool, not a {self.kind} one")
        with self.lock:
            self.from_json(data)


def check_saved(data: dict, expected: dict, path_hint: str = "pool file") -> None:
    """Refuse a saved pool whose structural settings differ from this pool's."""
    saved = data.get("settings", {})
    different = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
    if different:
        names = ", ".join(f"{k} (saved {a!r}, here {b!r})" for k, (a, b) in sorted(different.items()))
        raise ValueError(f"{path_hint} was saved with other settings: {names}")
