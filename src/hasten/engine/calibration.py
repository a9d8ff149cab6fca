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

from ..core.cost import BatchCost, CostCurve
from ..models.gguf import cache_root
from ..models.hf import runtime_of

CALIBRATION_CONTEXT = 96  # cached tokens before each timed block
CALIBRATION_REPS = 5  # timed reps per size (median kept), after one warm-up round
ROWS_CONTEXT = 32  # cached tokens per row before each timed batch step
ROWS = (1, 2, 4, 8, 16, 32)  # batch sizes timed on the batch path (rows of one token each)
LONG_CONTEXT = 1024  # cached tokens of the long row that prices attention per cached key


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


def load_or_calibrate_batch(model, root: Path | None = None) -> BatchCost:
    """What the batch path costs beyond the one-row curve (:class:`~hasten.core.cost.BatchCost`:
    by rows of one token each, ``ROWS_CONTEXT`` cached per row, and by cached keys attended
    over), cached on disk as :func:`load_or_calibrate`'s curve."""
    key = {**calibration_key(model), "path": "batch", "sizes": list(ROWS), "context": ROWS_CONTEXT,
           "long_context": LONG_CONTEXT}
    curve = _cached(key, root, lambda: calibrate_batch(model))
    # stored as one curve: the rows' seconds, then the seconds per key (at size 0)
    return BatchCost(CostCurve(curve.sizes[1:], curve.seconds[1:]), curve.seconds[0], CALIBRATION_CONTEXT)


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
def calibrate_batch(model, rows: tuple[int, ...] = ROWS, context: int = ROWS_CONTEXT,
                    reps: int = CALIBRATION_REPS) -> CostCurve:
    """Seconds of one batch step of ``r`` rows of one token each, for each ``r`` in ``rows``
    (medians; each size on a batch of its own, rows of ``context`` cached tokens), and, as the
    curve's point at size 0, seconds per cached key a position attends over (a row of
    ``CALIBRATION_CONTEXT`` against one of ``LONG_CONTEXT`` cached tokens, 8 tokens each)."""
    runtime = runtime_of(model)
    times = {}
    for count in rows:
        batch = runtime.batch(count)
        handles = [batch.add(_tokens(runtime, context + 1, r))[0] for r in range(count)]
        times[count] = _median_step(runtime, batch, handles, 1, reps)
        for handle in handles:
            batch.remove(handle)
    long = max(min(LONG_CONTEXT, (runtime.context_length or LONG_CONTEXT + 64) - 64), CALIBRATION_CONTEXT)
    step = {}
    for cached in (CALIBRATION_CONTEXT, long):
        batch = runtime.batch(1)
        handle = batch.add(_tokens(runtime, cached + 1, 0))[0]
        step[cached] = _median_step(runtime, batch, [handle], 8, reps)
        batch.remove(handle)
    per_key = max(step[long] - step[CALIBRATION_CONTEXT], 0.0) / (8 * max(long - CALIBRATION_CONTEXT, 1))
    return CostCurve((0, *rows), (per_key, *(times[r] for r in rows)))


def _tokens(runtime, count: int, seed: int) -> list[int]:
    vocab = runtime.vocab_size
    return [3 + (7 * i + 11 * seed) % max(vocab - 3, 1) for i in range(count)]  # any ids will do


def _median_step(runtime, batch, handles, tokens: int, reps: int) -> float:
    """Median seconds of one step of every row's ``tokens``-token chain, rolled back after each."""
    from ..core.tree import TokenTree

    seconds = []
    for rep in range(reps + 1):  # the first warms up
        starts = [h.cache_length for h in handles]
        clock = time.perf_counter()
        batch.forward_rows(handles, [[5] * tokens for _ in handles], [None] * len(handles), False)
        runtime.synchronize()
        if rep:
            seconds.append(time.perf_counter() - clock)
        for handle, start in zip(handles, starts):
            handle.commit(start, TokenTree.chain(tokens - 1), ())
            handle.crop(start)
    return statistics.median(seconds)
