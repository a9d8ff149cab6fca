"""``hasten train recipe``: every trained drafter of one model, from the conversations it wrote
itself (``hasten train data``), in one resumable command.

1. *Features* (:mod:`.features`): the target reads the committed conversations once; the hidden
   states every method reads are stored in ``WORK/features/`` (a later run extracts only the
   records written since).
2. *Training*, one method after another, each through its own
   :class:`~hasten.drafters.trainable.Trainable` on the stored features (:mod:`.feature_data`):
   held-out conversations by a fixed hash of their id, never trained on; checkpoints in
   ``WORK/<method>/`` from which a killed run resumes (on the rows the run began with); at every
   checkpoint the held-out loss and the drafter's teacher-forced acceptance per depth and tau
   (:mod:`.acceptance`), logged with the tokens trained on in ``WORK/acceptance.json`` and drawn
   in ``WORK/acceptance.png``.
3. *Weights*: ``OUT/<method>/`` in the layout the drafter loads, with its ``training.json``; with
   ``install``, also packed into the zoo (``src/hasten/zoo/weights/<zoo name>/<method>/``), where
   ``--method NAME`` finds them for the packaged model.

A method that finished is not trained again unless ``retrain`` (then from scratch, on every row
extracted by then).
"""
from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.settings import Settings, option
from .acceptance import ProbeSettings, probe
from .acceptance_log import AcceptanceLog
from .feature_data import FeatureData
from .features import FeatureSettings, FeatureStore, extract_features
from .trainer import CHECKPOINT, TrainSettings, train

RECIPE_METHODS = ("eagle3", "medusa", "eagle", "hidden_transfer", "chimera")  # the store serves them all
SHIPPED_LIMIT_BYTES = 20 * 2**20  # every module shipped for one model, together
DONE, FROZEN_ROWS = "done.json", "data.json"


@dataclass(frozen=True)
class RecipeSettings(Settings):
    methods: str = option(",".join(RECIPE_METHODS), "methods to train, in order, comma-separated")
    install: bool = option(False, "also install the weights, packed, into the zoo "
                                  "(src/hasten/zoo/weights/<zoo name>/<method>/; a zoo model only)")
    retrain: bool = option(False, "train again, from scratch, methods a run finished before")

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [m for m in self.method_list if m not in RECIPE_METHODS]
        if unknown or not self.method_list:
            raise ValueError(f"methods must be among {', '.join(RECIPE_METHODS)}; got {self.methods!r}")

    @property
    def method_list(self) -> list[str]:
        return [m.strip() for m in self.methods.split(",") if m.strip()]


def training_of(method: str):
    from ..drafters import REGISTRY

    return REGISTRY[method].Training


def stored_layers(model) -> tuple[int, ...]:
    """The hidden states every recipe method reads (their union: one store serves all of them)."""
    layers: set[int] = set()
    for method in RECIPE_METHODS:
        training = training_of(method)
        layers.update(training(model, training.Options()).feature_layers())
    return tuple(sorted(layers))


def probe_rows(store: FeatureStore, positions: int) -> list[tuple[list[int], int]]:
    """Held-out rows with greedy answers, in store order, until their answers hold ``positions``
    tokens or more (the same rows at every checkpoint and for every method)."""
    rows, tokens = [], 0
    for row in torch.nonzero(store.held_out & store.greedy_rows).flatten().tolist():
        if tokens >= positions:
            break
        rows.append((store.read(row, "ids").tolist(), int(store.prompt_lengths[row])))
        tokens += int(store.lengths[row] - store.prompt_lengths[row])
    return rows


def run_recipe(model, tokenizer, *, model_name: str, data_dir: Path, work_dir: Path, out_dir: Path,
               recipe: RecipeSettings, train_settings: TrainSettings, feature_settings: FeatureSettings,
               probe_settings: ProbeSettings, device: str = "cpu", progress: bool = True) -> dict:
    """Extract, train each method, write (and install) its weights; returns {method: report}."""
    work_dir, out_dir = Path(work_dir), Path(out_dir)
    model.requires_grad_(False).eval()
    started = time.monotonic()
    manifest = extract_features(model, tokenizer, data_dir, work_dir / "features", stored_layers(model),
                                feature_settings, model_name=model_name, device=device, progress=progress)
    extracted_s = time.monotonic() - started
    store = FeatureStore(work_dir / "features")
    print(f"features: {len(store)} rows ({int(store.lengths.sum())} tokens, {int(store.held_out.sum())} rows held "
          f"out) from {manifest.records_done} conversations; {extracted_s / 60:.1f} min this run", file=sys.stderr)
    log = AcceptanceLog(work_dir / "acceptance.json")
    rows_to_probe = probe_rows(store, probe_settings.probe_positions * 2)
    last_layer = model.config.get_text_config().num_hidden_layers
    reports = {}
    for method in recipe.method_list:
        method_dir = work_dir / method
        if (method_dir / DONE).is_file() and not recipe.retrain:
            reports[method] = json.loads((method_dir / DONE).read_text())
            print(f"{method}: finished before (--retrain trains it again)", file=sys.stderr)
            continue
        if recipe.retrain and (method_dir / DONE).is_file():
            shutil.rmtree(method_dir)
            log.drop(method)
        reports[method] = train_method(
            method, model, store, last_layer, rows_to_probe, log, method_dir, out_dir / method, model_name=model_name,
            train_settings=train_settings, probe_settings=probe_settings, device=device, progress=progress,
            extras={"features": {**dataclasses.asdict(feature_settings), "conversations": manifest.records_done,
                                 "extraction_minutes": round(manifest.seconds / 60, 1)}})
        if recipe.install:
            install(out_dir / method, model_name, method)
    (work_dir / "recipe.json").write_text(json.dumps(reports, indent=1) + "\n")
    return reports


def train_method(method: str, model, store: FeatureStore, last_layer: int, rows_to_probe: list, log: AcceptanceLog,
                 method_dir: Path, out: Path, *, model_name: str, train_settings: TrainSettings,
                 probe_settings: ProbeSettings, device: str, progress: bool, extras: dict) -> dict:
    """Train one method on the store (resuming its checkpoint), probe it at every checkpoint,
    write its weights to ``out``; returns its report (also ``method_dir/done.json``)."""
    from ..drafters import REGISTRY

    method_dir.mkdir(parents=True, exist_ok=True)
    frozen = method_dir / FROZEN_ROWS  # the rows this run trains on, kept for its resumption
    if not frozen.is_file() or not (method_dir / CHECKPOINT).is_file():
        frozen.write_text(json.dumps({"rows": len(store)}) + "\n")
    training = REGISTRY[method].Training
    trainable = training(model, training.Options())
    data = FeatureData(store, trainable.feature_layers(), last_layer, rows=json.loads(frozen.read_text())["rows"])

    def acceptance(module, info: dict) -> dict:
        probe_dir = method_dir / "probe"
        trainable.save(module, probe_dir, {"target": model_name, "eval": info["eval"]})
        measured = probe(REGISTRY[method], str(probe_dir), model, rows_to_probe, probe_settings)
        log.add({"method": method, "step": info["step"], "tokens": info["tokens"],
                 "minutes": info.get("minutes"), **measured})
        log.draw(log.path.with_suffix(".png"))
        return {"tau": measured["tau"], "acceptance": measured["acceptance"], "tree_tau": measured["tree_tau"]}

    result = train(trainable, data, train_settings, method_dir, resume=(method_dir / CHECKPOINT).is_file(),
                   device=device, progress=progress, extra_evaluation=acceptance)
    train_rows, held_rows = data.split()
    report = {
        "drafter": method, "target": model_name, **result.report,
        "options": dataclasses.asdict(trainable.options),
        "data": {"rows": len(data), "training_rows": len(train_rows), "held_out_rows": len(held_rows),
                 "training_tokens": int((data.lengths - data.prompt_lengths)[train_rows].sum()), **extras},
        "acceptance": log.of(method)[-1] if log.of(method) else None,
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                    "device": device},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    out.mkdir(parents=True, exist_ok=True)
    trainable.save(result.module, out, report)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    (method_dir / DONE).write_text(json.dumps(report, indent=1) + "\n")
    print(f"{method}: {report['steps']} steps, {report['tokens']} tokens in {report['minutes']} min; held-out "
          f"tau {report['acceptance'] and report['acceptance']['tau']} -> {out}", file=sys.stderr)
    return report


def install(trained: Path, model_name: str, method: str) -> Path:
    """Copy ``trained`` into the zoo beside the other modules shipped for ``model_name`` and pack it;
    refused when the shipped modules of that model would pass SHIPPED_LIMIT_BYTES together."""
    from ..zoo.packing import pack
    from ..zoo.real import SHIPPED_DRAFTERS

    if not model_name.startswith("zoo:"):
        raise ValueError(f"install ships weights for zoo models only, not {model_name!r}")
    home = SHIPPED_DRAFTERS / model_name.removeprefix("zoo:")
    target = home / method
    staging = home / f".{method}.new"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(trained, staging)
    pack(staging)
    for unpacked in staging.glob("*.safetensors"):
        unpacked.unlink()  # the zoo ships packed files only
    others = sum(p.stat().st_size for p in home.rglob("*") if p.is_file() and target not in p.parents
                 and staging not in p.parents)
    mine = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    if others + mine > SHIPPED_LIMIT_BYTES:
        shutil.rmtree(staging)
        raise ValueError(f"installing {method} would ship {(others + mine) / 2**20:.1f} MB for {model_name} "
                         f"(limit {SHIPPED_LIMIT_BYTES / 2**20:.0f} MB)")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target
