"""Training-free feature caching for diffusion transformers, as hooks on unmodified models.

    from hasten.diffusion import cached, TaylorSeer
    with cached(pipe.transformer, TaylorSeer(interval=4, order=2)) as session:
        images = pipe(...)
    print(session.stats.skipped_fraction)

Policies: ``TaylorSeer``, ``BlockAdaptive`` (BAC, calibrated with ``calibrate``), and the baselines
``FixedInterval`` and ``FirstBlockCache``; ``NoCache`` computes everything. See docs/diffusion.md.
"""
from .bac import BlockAdaptive, Calibration, calibrate
from .hooks import CacheSession, CacheStats, cached, disable_cache, enable_cache
from .policies import FirstBlockCache, FixedInterval, NoCache, TaylorSeer, describe

__all__ = [
    "BlockAdaptive", "CacheSession", "CacheStats", "Calibration", "FirstBlockCache", "FixedInterval",
    "NoCache", "TaylorSeer", "cached", "calibrate", "describe", "disable_cache", "enable_cache",
]
