"""The target's forward cost on this machine, measured once and cached: the cost curve that
cost-aware draft sizing (:mod:`hasten.engine.sizing`) and the replay price forwards with.

Each runtime names what its forward's cost depends on (``Runtime.cost_key``) and runs its own
timed forwards (``Runtime.timing_blocks``); this module adds the machine, times the block
sizes interleaved (medians, after a warm-up round) and keeps the curve on disk under
``$HASTEN_CACHE/cost``, one file per key.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..core.cost import CostCurve
from ..models.gguf import cache_root
from ..models.hf import runtime_of

CALIBRATION_CONTEXT = 96  # cached tokens before each timed block
CALIBRATION_REPS = 5  # timed reps per size (median kept), after one warm-up round
ROWS_CONTEXT = 32  # cached tokens per row before each timed batch step
ROWS = (1, 2, 4, 8, 16, 32)  # batch sizes timed on the batch path (rows of one token each)


@functools.lru_cache(maxsize=1)
def _cpu_name() -> str:
    from ..machine import cpu_model

    return cpu_model()


def calibration_key(model) -> dict:
    """What a forward's cost depends on: the model and how it runs (its runtime's
    ``cost_key``), the block sizes timed, and the machine."""
    runtime = runtime_of(model)
    machine = f"{_cpu_name()} x{os.cpu_count()} {platform.node()}"
    return {**runtime.cost_key(), "machine": machine, "sizes": list(runtime.calibration_sizes)}


def cost_file(key: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root or cache_root()) / "cost" / f"{digest}.json"


@torch.no_grad()
def calibrate(model, sizes: tuple[int, ...] | None = None, context: int = CALIBRATION_CONTEXT,
              reps: int = CALIBRATION_REPS) -> CostCurve:
    """Time the target's forward over each block size after ``context`` cached tokens
    (median of ``reps``, sizes interleaved so drift falls on all alike), each forward run
    by the model's runtime (``timing_blocks``)."""
    runtime = runtime_of(model)
    sizes = sizes or runtime.calibration_sizes
    vocab = runtime.vocab_size
    tokens = [3 + (7 * i) % max(vocab - 3, 1) for i in range(context + 2 + max(sizes))]  # any ids will do
    with runtime.timing_blocks(tokens, context, sizes) as (sizes, run, undo):
        return _time_blocks(sizes, reps, run, undo)


def _time_blocks(sizes: tuple[int, ...], reps: int, run, undo) -> CostCurve:
    """Seconds of ``run(size)`` for each size: the median of ``reps`` rounds after a warm-up
    round, sizes interleaved; ``undo()`` after each run restores the cached context."""
    times: dict[int, list[float]] = {s: [] for s in sizes}
    rounds = tqdm(range(reps + 1), desc="timing the target's forward (once per model and machine)", unit="round",
                  leave=False, disable=None)  # a progress bar on a terminal only
    for rep in rounds:  # the first round warms up
        for size in sizes:
            clock = time.perf_counter()
            run(size)
            if rep:
                times[size].append(time.perf_counter() - clock)
            undo()
    return CostCurve(tuple(sizes), tuple(statistics.median(times[s]) for s in sizes))


_MEMO: dict[Path, CostCurve] = {}


def load_or_calibrate(model, root: Path | None = None) -> CostCurve:
    """The model's cost curve from the disk cache, calibrating (and saving) on first use."""
    return _cached(calibration_key(model), root, lambda: calibrate(model))


def load_or_calibrate_rows(model, root: Path | None = None) -> CostCurve:
    """The batch path's cost by rows (one token each, ``ROWS_CONTEXT`` cached per row), cached
    on disk as :func:`load_or_calibrate`'s curve: what a batch of packed rows costs more than
    one row running as many tokens (each row's attention, its bookkeeping)."""
    key = {**calibration_key(model), "path": "batch rows", "sizes": list(ROWS), "context": ROWS_CONTEXT}
    return _cached(key, root, lambda: calibrate_rows(model))


def _cached(key: dict, root: Path | None, measure) -> CostCurve:
    path = cost_file(key, root)
    if path in _MEMO:
        return _MEMO[path]
    curve = None
    if path.is_file():
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                curve = CostCurve(tuple(saved["sizes"]), tuple(saved["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            curve = None  # a damaged file is measured again
    if curve is None:
        curve = measure()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_suffix(".tmp")
            scratch.write_text(json.dumps({"key": key, "sizes": curve.sizes, "seconds": curve.seconds}, indent=1))
            scratch.replace(path)
        except OSError:
            pass  # an unwritable cache only costs a calibration next time
    _MEMO[path] = curve
    return curve


@torch.no_grad()
def calibrate_rows(model, rows: tuple[int, ...] = ROWS, context: int = ROWS_CONTEXT,
                   reps: int = CALIBRATION_REPS) -> CostCurve:
    """Seconds of one batch step of ``r`` rows of one token each, for each ``r`` in ``rows``
    (medians; each size on a batch of its own, rows of ``context`` cached tokens)."""
    from ..core.tree import TokenTree

    runtime = runtime_of(model)
    vocab = runtime.vocab_size
    times = {}
    for count in rows:
        batch = runtime.batch(count)
        handles = [batch.add([3 + (7 * i + 11 * r) % max(vocab - 3, 1) for i in range(context + 1)])[0]
                   for r in range(count)]

        def run() -> None:
            starts = [h.cache_length for h in handles]
            batch.forward_rows(handles, [[5] for _ in handles], [None] * count, False)
            runtime.synchronize()
            for handle, start in zip(handles, starts):
                handle.commit(start, TokenTree.chain(0), ())
                handle.crop(start)

        seconds = []
        for rep in range(reps + 1):  # the first warms up
            clock = time.perf_counter()
            run()
            if rep:
                seconds.append(time.perf_counter() - clock)
        times[count] = statistics.median(seconds)
        for handle in handles:
            batch.remove(handle)
    return CostCurve(tuple(rows), tuple(times[r] for r in rows))
