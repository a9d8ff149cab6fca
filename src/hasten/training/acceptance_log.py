"""The held-out acceptance of every method against the tokens it has trained on: one JSON file
(``acceptance.json`` in the recipe's work dir) and its chart (``acceptance.png``).

Each entry: ``{"method", "step", "tokens" (label tokens trained on), "minutes", "positions",
"acceptance" [per depth], "tau", "tree_acceptance", "tree_tau"}``. A resumed run appends; an
entry of a step already logged for a method replaces it (a run killed after logging a checkpoint
it had not saved measures that step again).
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class AcceptanceLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries: list[dict] = json.loads(self.path.read_text()) if self.path.is_file() else []

    def add(self, entry: dict) -> None:
        self.entries = [e for e in self.entries if (e["method"], e["step"]) != (entry["method"], entry["step"])]
        self.entries.append(entry)
        self.entries.sort(key=lambda e: (e["method"], e["step"]))
        self._write()

    def _write(self) -> None:
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.entries, indent=1) + "\n")
        os.replace(temporary, self.path)

    def drop(self, method: str) -> None:
        """Forget a method's entries (it is trained again from scratch)."""
        self.entries = [e for e in self.entries if e["method"] != method]
        self._write()

    def methods(self) -> list[str]:
        return sorted({e["method"] for e in self.entries})

    def of(self, method: str) -> list[dict]:
        return [e for e in self.entries if e["method"] == method]

    def draw(self, png: str | Path) -> None:
        """One panel per method: the chain's acceptance at each depth (solid) and tau (dashed,
        right axis) against the label tokens trained on."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        methods = self.methods()
        if not methods:
            return
        figure, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.6), squeeze=False)
        for ax, method in zip(axes[0], methods):
            entries = self.of(method)
            tokens = [e["tokens"] for e in entries]
            for d in range(len(entries[-1]["acceptance"])):
                ax.plot(tokens, [e["acceptance"][d] if d < len(e["acceptance"]) else 0 for e in entries],
                        marker="o", markersize=3, label=f"depth {d + 1}")
            ax.set_ylim(0, 1)
            ax.set_xlabel("training tokens (answer labels seen)")
            ax.set_ylabel("held-out acceptance")
            ax.set_title(f"{method}: tau {entries[-1]['tau']:.2f}")
            ax.grid(alpha=0.3)
            right = ax.twinx()
            right.plot(tokens, [e["tau"] for e in entries], color="black", linestyle="--", marker="x", label="tau")
            right.set_ylabel("tau (chain, dashed)")
            right.set_ylim(1, 1 + len(entries[-1]["acceptance"]))  # tau runs from 1 to 1 + depth
            ax.legend(fontsize=7, loc="upper left")
        figure.tight_layout()
        temporary = Path(png).with_suffix(".tmp.png")
        figure.savefig(temporary, dpi=110)
        plt.close(figure)
        os.replace(temporary, png)
