"""The one learning-rate schedule every trainer in hasten uses (drafters, zoo models, diffusion models)."""
from __future__ import annotations

import math


def warmup_cosine(step: int, warmup_steps: int, progress: float, final_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate: linear warmup over the first ``warmup_steps``
    steps, times a cosine decay from 1 to ``final_ratio`` as ``progress`` goes from 0 to 1
    (progress outside [0, 1] is clamped; a trainer measures it in steps or in wall-clock time)."""
    warmup = min(1.0, (step + 1) / max(1, warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return warmup * (final_ratio + (1.0 - final_ratio) * cosine)
