"""The strict check of an exported drafter against the layout its engine declares."""
from __future__ import annotations

import torch

from ..arguments import UserError

Shape = tuple[int, ...]


class ExportError(UserError):
    """What hasten would write is not exactly what the engine loads, or cannot be expressed."""


def check(tensors: dict[str, torch.Tensor], expected: dict[str, Shape], engine: str) -> None:
    """``tensors`` must hold exactly the names of ``expected``, each of its shape and a floating
    dtype; raises :class:`ExportError` listing every difference."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{name} {tuple(tensors[name].shape)} (expected {expected[name]})"
              for name in sorted(set(tensors) & set(expected)) if tuple(tensors[name].shape) != expected[name]]
    dtypes = [f"{name} {tensors[name].dtype}" for name in sorted(tensors) if not tensors[name].is_floating_point()]
    problems = [f"{what}: {', '.join(items)}" for what, items in
                (("missing", missing), ("unexpected", unexpected), ("wrong shape", shapes), ("not floating", dtypes))
                if items]
    if problems:
        raise ExportError(f"the export does not match what {engine} loads; " + "; ".join(problems))
