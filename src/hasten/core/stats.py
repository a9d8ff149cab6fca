"""DecodeStats: what a generation cost, and how well the drafts did."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import zip_longest
from typing import Iterable

# Fields that are a peak, not a count: adding two stats keeps the larger (None: not measured).
PEAK_FIELDS = ("target_kv_bytes", "drafter_kv_bytes")


@dataclass
class DecodeStats:
    steps: int = 0  # target forwards that produced tokens (prefill not counted)
    new_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # draft tokens accepted, bonus excluded
    forced_tokens: int = 0  # of those, tokens of text a constraint forced, proposed as drafts (hasten.engine.constraint)
    drafted_at_depth: list[int] = field(default_factory=list)  # steps with a draft node at depth d + 1
    accepted_at_depth: list[int] = field(default_factory=list)  # steps whose accepted path reached depth d + 1
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # target forward + acceptance + cache commit
    # KV memory at the end of the generation (caches only grow, so this is their peak but for
    # a step's scratch): the target's cache (a lossy compression's or llama.cpp's own when they
    # report it) and the drafter's own caches (Drafter.cache_bytes); None where not measured
    target_kv_bytes: int | None = None
    drafter_kv_bytes: int | None = None

    def record(self, max_depth: int, drafted: int, accepted: int, committed: int) -> None:
        self.steps += 1
        self.new_tokens += committed
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        for counts, depth in ((self.drafted_at_depth, max_depth), (self.accepted_at_depth, accepted)):
            counts.extend([0] * (depth - len(counts)))
            for d in range(depth):
                counts[d] += 1

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        """Counts and seconds added up field by field (lists element-wise), so tau and
        acceptance of several generations aggregate weighted by steps."""
        total = DecodeStats()
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name in PEAK_FIELDS:  # the peak of several generations is the largest one's
                known = [x for x in (mine, theirs) if x is not None]
                merged = max(known) if known else None
            elif isinstance(mine, list):
                merged = [a + b for a, b in zip_longest(mine, theirs, fillvalue=0)]
            else:
                merged = mine + theirs
            setattr(total, f.name, merged)
        return total

    @property
    def mean_accepted(self) -> float:
        """tau: new tokens per target forward, bonus included (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of steps that drafted position d + 1 and had it accepted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at_depth + [0] * len(self.drafted_at_depth), self.drafted_at_depth)]

    @property
    def forced_share(self) -> float:
        """Share of the new tokens that came from forced drafts (text a constraint forced)."""
        return self.forced_tokens / self.new_tokens if self.new_tokens else 0.0

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.draft_seconds + self.verify_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "new_tokens": self.new_tokens,
            "mean_accepted": round(self.mean_accepted, 4),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "forced_tokens": self.forced_tokens,
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "prefill_seconds": round(self.prefill_seconds, 6),
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "target_kv_bytes": self.target_kv_bytes,
            "drafter_kv_bytes": self.drafter_kv_bytes,
        }


# ---- KV memory -------------------------------------------------------------------------------------
def allocated_bytes(tensors: Iterable) -> int:
    """Bytes of memory behind ``tensors`` (None entries skipped): each distinct storage counted
    once and whole, since a cropped cache's view, or a buffer's filled part, keeps all of
    its storage allocated."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def cache_bytes(cache) -> int:
    """Allocated bytes of a Hugging Face KV cache: a ``DynamicCache`` (layers with ``keys``
    and ``values``) or both halves of an ``EncoderDecoderCache``. A layer that says what it
    holds (``held_bytes()``: hasten's growing layers, whose spare capacity of a few dozen
    entries is not counted) is taken at its word. Duck-typed: this floor imports nothing from
    transformers' cache classes."""
    halves = [getattr(cache, name, None) for name in ("self_attention_cache", "cross_attention_cache")]
    caches = [half for half in halves if half is not None] or [cache]
    layers = [layer for c in caches for layer in getattr(c, "layers", ())]
    held = [layer for layer in layers if callable(getattr(layer, "held_bytes", None))]
    return sum(layer.held_bytes() for layer in held) + allocated_bytes(
        getattr(layer, part, None) for layer in layers if layer not in held for part in ("keys", "values"))


def holder_kv_bytes(holder) -> int | None:
    """KV bytes of something holding a cache: its own ``cache_bytes()`` if it has one (a
    llama.cpp session may), else its Hugging Face ``cache`` attribute (a ModelAdapter's);
    None when neither is there."""
    own = getattr(holder, "cache_bytes", None)
    if callable(own):
        return own()
    cache = getattr(holder, "cache", None)
    return None if cache is None else cache_bytes(cache)
