"""The target's features over self-generated conversations, extracted once per model and read
by every trained drafter (:mod:`.feature_data`).

What is stored, per row (:mod:`.conversations`: one answer with the prompt it answered): the
token ids, the target's greedy next token at every position, and the residual stream at the
hidden-state indices the methods read (Hugging Face's ``hidden_states[k]``; the union over
the methods, so EAGLE-3's low, middle and high layers and the last layer that EAGLE, Medusa
and Chimera read), in bfloat16 or float16. Hidden transfer reads none: its placeholders run
through the target's own upper layers at every training step.

A store is a directory: ``manifest.json`` (the key it was made with and the committed shards)
and ``shard-NNNNN.safetensors`` files, one per commit::

    ids [N] int32, greedy [N] int32       every row's tokens, end to end
    offsets [R + 1] int64                 row r is positions offsets[r] .. offsets[r + 1]
    prompt_lengths, records [R] int32     the answer starts at prompt_lengths[r]; its record's index
    greedy_rows, held_out [R] uint8       its answer is greedy; its record is held out
    layer.K [N, H]                        hidden_states[K] at every position

Extraction reads the committed records (``progress.json`` of the data directory) past those
the manifest has done, runs the target over their rows ``extract_batch`` at a time (right
padding: a causal model's earlier positions never see it), and commits a shard, then the
manifest, every ``commit_minutes`` at the end of a batch that ends a record. A killed run
loses at most that much work; the next run starts at the last commit with the same batches
an uninterrupted run makes from there, so it writes the same features. A later run picks up
records written since.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..core.settings import Settings, option
from .conversations import ConversationRow, conversation_rows
from .selfgen import PROGRESS, read_records

MANIFEST = "manifest.json"
GREEDY_CHUNK = 256  # positions whose LM-head logits are formed at once (the vocabulary is wide)


@dataclass(frozen=True)
class FeatureSettings(Settings):
    feature_dtype: str = option("bfloat16", "dtype of the stored hidden states: bfloat16 or float16")
    extract_batch: int = option(8, "rows the target reads per forward while extracting features")
    max_tokens: int = option(1024, "most tokens of a row (prompt and answer); longer rows are cut")
    commit_minutes: float = option(2.0, "minutes between commits of extracted features (what a kill can lose)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"feature_dtype must be bfloat16 or float16, got {self.feature_dtype!r}")
        if self.extract_batch < 1 or self.max_tokens < 2:
            raise ValueError("extract_batch must be >= 1 and max_tokens >= 2")
        if self.commit_minutes <= 0:
            raise ValueError(f"commit_minutes must be > 0, got {self.commit_minutes}")


@dataclass
class Manifest:
    key: dict
    records_done: int = 0  # committed records of the data read so far (in index order)
    shards: list = None  # [{"name", "rows", "tokens"}] in commit order
    seconds: float = 0.0  # extraction wall time over every run

    def __post_init__(self) -> None:
        self.shards = self.shards or []

    def save(self, directory: Path) -> None:
        temporary = directory / (MANIFEST + ".tmp")
        temporary.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(temporary, directory / MANIFEST)

    @property
    def rows(self) -> int:
        return sum(shard["rows"] for shard in self.shards)


def store_key(model_name: str, data_dir: Path, layers: tuple[int, ...], settings: FeatureSettings) -> dict:
    """What decides a store's contents: the model, the data (its generation settings), the layers, the form."""
    data_key = json.loads((Path(data_dir) / PROGRESS).read_text())["key"]
    return {"model": model_name, "data": data_key, "layers": sorted(set(layers)),
            "dtype": settings.feature_dtype, "max_tokens": settings.max_tokens}


def open_manifest(store_dir: Path, key: dict) -> Manifest:
    """The store's committed manifest (shards written after it removed), or a fresh one."""
    store_dir.mkdir(parents=True, exist_ok=True)
    path = store_dir / MANIFEST
    manifest = Manifest(**json.loads(path.read_text())) if path.is_file() else Manifest(key)
    if manifest.key != key:
        changed = sorted(k for k in set(key) | set(manifest.key) if key.get(k) != manifest.key.get(k))
        raise ValueError(f"{store_dir} holds features made otherwise ({', '.join(changed)}); use another work dir")
    committed = {shard["name"] for shard in manifest.shards}
    for shard in store_dir.glob("shard-*.safetensors"):
        if shard.name not in committed:
            shard.unlink()  # written by a run killed before its manifest
    return manifest


@torch.no_grad()
def row_features(model, rows: list[ConversationRow], layers: tuple[int, ...], dtype: torch.dtype,
                 device: str) -> list[dict[str, torch.Tensor]]:
    """One forward over ``rows`` (right-padded) -> each row's ``greedy`` [n] and ``layer.K`` [n, H] (CPU)."""
    width = max(len(row.ids) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, T]
    for b, row in enumerate(rows):
        ids[b, : len(row.ids)] = torch.tensor(row.ids)
    out = model(ids.to(device), output_hidden_states=True, logits_to_keep=1)
    lm_head = model.get_output_embeddings()
    last = out.hidden_states[-1]  # [B, T, H] what the LM head reads
    greedy = torch.cat([lm_head(chunk).argmax(-1) for chunk in last.split(GREEDY_CHUNK, 1)], 1).cpu()  # [B, T]
    result = []
    for b, row in enumerate(rows):
        n = len(row.ids)
        tensors = {"greedy": greedy[b, :n].int()}
        tensors.update({f"layer.{k}": out.hidden_states[k][b, :n].to(dtype).cpu() for k in layers})
        result.append(tensors)
    return result


def write_shard(store_dir: Path, manifest: Manifest, rows: list[ConversationRow],
                features: list[dict[str, torch.Tensor]], layers: tuple[int, ...]) -> dict:
    """The rows as one shard file (written under a temporary name, then renamed); returns its entry."""
    lengths = torch.tensor([len(row.ids) for row in rows])
    tensors = {
        "ids": torch.tensor([t for row in rows for t in row.ids], dtype=torch.int32),
        "greedy": torch.cat([f["greedy"] for f in features]),
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "prompt_lengths": torch.tensor([row.prompt_length for row in rows], dtype=torch.int32),
        "records": torch.tensor([row.record for row in rows], dtype=torch.int32),
        "greedy_rows": torch.tensor([row.greedy for row in rows], dtype=torch.uint8),
        "held_out": torch.tensor([row.held_out for row in rows], dtype=torch.uint8),
        **{f"layer.{k}": torch.cat([f[f"layer.{k}"] for f in features]) for k in layers},
    }
    name = f"shard-{len(manifest.shards):05d}.safetensors"
    temporary = store_dir / (name + ".tmp")
    save_file(tensors, temporary)
    os.replace(temporary, store_dir / name)
    return {"name": name, "rows": len(rows), "tokens": int(lengths.sum())}


def extract_features(model, tokenizer, data_dir: str | Path, store_dir: str | Path, layers: tuple[int, ...],
                     settings: FeatureSettings, *, model_name: str, device: str = "cpu",
                     progress: bool = True, stop_after_rows: int | None = None) -> Manifest:
    """Extract the features of the committed records of ``data_dir`` not yet in ``store_dir``.
    ``stop_after_rows`` ends the run after about that many rows (at a commit: for tests of an
    interruption); returns the manifest committed last."""
    store_dir, layers = Path(store_dir), tuple(sorted(set(layers)))
    manifest = open_manifest(store_dir, store_key(model_name, Path(data_dir), layers, settings))
    records = list(read_records(data_dir))[manifest.records_done:]
    ordinal = {record["index"]: i for i, record in enumerate(records)}
    rows = list(conversation_rows(records, tokenizer, settings.max_tokens))
    dtype = getattr(torch, settings.feature_dtype)
    bar = tqdm(total=sum(len(row.ids) for row in rows), unit="tok", unit_scale=True, desc="features",
               disable=not progress, file=sys.stderr, mininterval=10, dynamic_ncols=True)
    pending: list[tuple[ConversationRow, dict]] = []
    committed_at, done_here = time.monotonic(), 0

    def commit(records_done: int) -> None:
        nonlocal pending, committed_at
        if pending:
            manifest.shards.append(write_shard(store_dir, manifest, *zip(*pending), layers))
        manifest.records_done += records_done
        manifest.seconds = round(manifest.seconds + time.monotonic() - committed_at, 1)
        manifest.save(store_dir)
        pending, committed_at = [], time.monotonic()

    taken = 0  # records of this run's list covered by committed or pending rows
    for start in range(0, len(rows), settings.extract_batch):
        batch = rows[start : start + settings.extract_batch]
        pending.extend(zip(batch, row_features(model, batch, layers, dtype, device)))
        done_here += len(batch)
        bar.update(sum(len(row.ids) for row in batch))
        end = start + len(batch)
        at_record_end = end == len(rows) or rows[end].record != rows[end - 1].record
        due = time.monotonic() - committed_at >= settings.commit_minutes * 60
        if at_record_end and end < len(rows) and (due or (stop_after_rows and done_here >= stop_after_rows)):
            covered = ordinal[rows[end].record]  # every record before the next row's is complete
            commit(covered - taken)
            taken = covered
            if stop_after_rows and done_here >= stop_after_rows:
                bar.close()
                return manifest
    commit(len(records) - taken)
    bar.close()
    return manifest


class FeatureStore:
    """The committed rows of a store, read lazily (safetensors slices, memory-mapped)."""

    def __init__(self, store_dir: str | Path):
        self.dir = Path(store_dir)
        self.manifest = Manifest(**json.loads((self.dir / MANIFEST).read_text()))
        self.layers = tuple(self.manifest.key["layers"])
        self._files: dict[str, safe_open] = {}
        where, prompt_lengths, records, greedy_rows, held_out, lengths = [], [], [], [], [], []
        for shard in self.manifest.shards:
            f = self._file(shard["name"])
            offsets = f.get_tensor("offsets")
            where += [(shard["name"], int(a), int(b)) for a, b in zip(offsets[:-1], offsets[1:])]
            lengths.append(offsets[1:] - offsets[:-1])
            prompt_lengths.append(f.get_tensor("prompt_lengths").long())
            records.append(f.get_tensor("records").long())
            greedy_rows.append(f.get_tensor("greedy_rows").bool())
            held_out.append(f.get_tensor("held_out").bool())
        cat = lambda parts, dtype: torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)  # noqa: E731
        self.where = where  # row -> (shard, start, end)
        self.lengths = cat(lengths, torch.long)  # [R]
        self.prompt_lengths = cat(prompt_lengths, torch.long)  # [R]
        self.records = cat(records, torch.long)  # [R]
        self.greedy_rows = cat(greedy_rows, torch.bool)  # [R]
        self.held_out = cat(held_out, torch.bool)  # [R]

    def __len__(self) -> int:
        return len(self.where)

    def _file(self, name: str):
        if name not in self._files:
            self._files[name] = safe_open(self.dir / name, "pt")
        return self._files[name]

    def read(self, row: int, field: str) -> torch.Tensor:
        """One row's ``ids`` [n], ``greedy`` [n] or ``layer.K`` [n, H]."""
        name, start, end = self.where[row]
        return self._file(name).get_slice(field)[start:end]
