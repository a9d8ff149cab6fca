"""A feature store (:mod:`.features`) as the data a :class:`~hasten.drafters.trainable.Trainable`
trains on: what :func:`hasten.training.trainer.train` asks of distilled data (``split``,
``batch``, ``ids`` / ``lengths`` / ``prompt_lengths``), read from the stored features instead of
running the target.

Training rows are the rows of conversations that are not held out; evaluation rows are the held
out ones (:func:`~.conversations.is_held_out`), so no held-out token is ever trained on. ``rows``
freezes the data a run trains on (the first rows of the store), so that a resumed run reads the
same rows however many were extracted since.
"""
from __future__ import annotations

import torch

from ..drafters.trainable import Batch
from .features import FeatureStore


class FeatureData:
    stores_greedy = True  # every batch brings the target's greedy next tokens

    def __init__(self, store: FeatureStore, layers: tuple[int, ...], last_layer: int, rows: int | None = None):
        """``layers``: the hidden-state indices a method reads; ``last_layer``: the target's last
        (its ``num_hidden_layers``), which batches also hold as ``Batch.hidden`` when read."""
        missing = set(layers) - set(store.layers)
        if missing:
            raise ValueError(f"the feature store {store.dir} lacks hidden states {sorted(missing)}")
        self.store, self.layers = store, tuple(layers)
        self.size = len(store) if rows is None else min(rows, len(store))
        self.lengths = store.lengths[: self.size]  # [R]
        self.prompt_lengths = store.prompt_lengths[: self.size]  # [R]
        self._ids: torch.Tensor | None = None
        self.last = last_layer

    def __len__(self) -> int:
        return self.size

    @property
    def ids(self) -> torch.Tensor:
        """[R, L] every row's tokens, zero-padded (read once, on first use)."""
        if self._ids is None:
            width = int(self.lengths.max()) if self.size else 0
            self._ids = torch.zeros(self.size, width, dtype=torch.long)
            for row in range(self.size):
                self._ids[row, : self.lengths[row]] = self.store.read(row, "ids").long()
        return self._ids

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices for training and for held-out evaluation (held-out conversations only)."""
        held_out = self.store.held_out[: self.size]
        rows = torch.arange(self.size)
        return rows[~held_out], rows[held_out]

    def batch(self, rows: torch.Tensor, target, device: str = "cpu") -> Batch:
        """The rows, right-padded: ids, the answer positions as labels, the stored features."""
        lengths = self.lengths[rows]
        width = int(lengths.max())
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
        greedy = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
        features = {k: None for k in self.layers}
        for b, row in enumerate(rows.tolist()):
            n = int(lengths[b])
            ids[b, :n] = self.store.read(row, "ids").long()
            greedy[b, :n] = self.store.read(row, "greedy").long()
            for k in self.layers:
                states = self.store.read(row, f"layer.{k}")  # [n, H]
                if features[k] is None:
                    features[k] = torch.zeros(len(rows), width, states.shape[-1])  # [B, T, H]
                features[k][b, :n] = states.float()
        position = torch.arange(width)[None]  # [1, T]
        label_mask = (position >= self.prompt_lengths[rows, None]) & (position < lengths[:, None])  # [B, T]
        features = {k: v.to(device) for k, v in features.items()}
        hidden = features.get(self.last)
        return Batch(ids.to(device), hidden, label_mask.to(device), features=features, greedy=greedy.to(device))
