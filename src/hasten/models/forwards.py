"""Which forwards are hasten's: a flag for the current thread, set around every forward the
decode loop, the batch and the bench run (:func:`active`).

Inside them a prepared CPU model's layers run hasten's own kernels (models/invariant.py);
outside them (a Hugging Face ``generate`` of the same model object, training, the user's own
calls) the same modules run PyTorch's, as if hasten had never touched the model."""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

_state = threading.local()  # .on: this thread is running one of hasten's forwards


def is_active() -> bool:
    """Whether this thread is inside one of hasten's forwards."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def active(on: bool = True) -> Iterator[None]:
    """Within it, this thread's forwards are hasten's (``on=False``: PyTorch's again)."""
    before = is_active()
    _state.on = on
    try:
        yield
    finally:
        _state.on = before
