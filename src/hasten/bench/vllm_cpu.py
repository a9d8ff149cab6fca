"""vLLM's CPU build as a baseline of ``hasten bench``: what a user who outgrows one process
runs instead, on the same model directory, prompts, token budget and thread count.

vLLM pins other versions of torch and transformers than hasten, so it lives in its own
environment (``make vllm``: ``.venv-vllm``) and runs in a worker process
(:mod:`hasten.bench.vllm_worker`), one per baseline, that the runner asks for one prompt
at a time, interleaved with every other method as usual. The worker times
``LLM.generate`` itself, so the pipe costs nothing.

* ``vllm``: plain greedy decoding;
* ``vllm_ngram``: vLLM's n-gram speculation (its prompt lookup): 5 speculative tokens,
  n-grams of 2 to 4 tokens;
* ``vllm_prompt_lookup``: vLLM with hasten's prompt lookup as its proposer
  (:class:`hasten.vllm.PromptLookup`), each request's depth chosen by hasten's cost-aware
  sizing, up to 10 tokens (hasten's own ``prompt_lookup`` depth). vLLM verifies; only the
  drafts are hasten's.
* ``vllm_prompt_lookup_fixed``: the same rule at vLLM's fixed depth of 5
  (:class:`hasten.vllm.FixedPromptLookup`): the same depth as ``vllm_ngram``, hasten's matching.
* ``vllm_lookahead``: hasten's lookahead trie's likeliest chain (:class:`hasten.vllm.Lookahead`),
  sized as ``vllm_prompt_lookup``, up to 10 tokens.
* ``vllm_suffix``: vLLM's own suffix decoding (``method="suffix"``, arctic-inference's trees;
  it needs ``arctic_inference`` importable in vLLM's environment: ``make vllm-suffix``), 24 tokens
  at most;
  ``vllm_hasten_suffix`` and ``vllm_hasten_suffix_fixed``: hasten's port of the same algorithm
  through :class:`hasten.vllm.Suffix` (sized) and :class:`hasten.vllm.FixedSuffix` (as deep as
  the match allows, as vLLM's).
* ``vllm_medusa``: vLLM with hasten's trained Medusa heads for the model (found as hasten's
  ``medusa`` method finds them), exported into vLLM's layout (:mod:`hasten.export`) in a
  temporary folder; as many speculative tokens as heads. Asked for by name only (not in
  ``--baselines auto``). Its per-position acceptance (vLLM's own counters) sits beside hasten's
  in results.json: with ``--method-arg medusa.top_k=1 --method-arg medusa.tree_size=HEADS``
  hasten drafts the same top-1 chain vLLM does.

Both run in the model's own dtype. vLLM's default (``dtype="auto"``) would run a float32
checkpoint in bfloat16 on a CPU (it downcasts float32 models to the platform's preferred
16-bit type), a different model with other outputs; a float32 run is the comparison with
Hugging Face and hasten on the same weights. vLLM's kernels round otherwise than PyTorch's
own, so its greedy tokens may leave hasten's at a near-tie: the runner reports such prompts
(``identical``) instead of stopping, as it does for hasten's own methods.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..arguments import UserError
from ..core.stats import DecodeStats
from ..models.quantize import is_quantized
from .runner import Method

VLLM = "vllm"
VLLM_NGRAM = "vllm_ngram"
VLLM_PROMPT_LOOKUP = "vllm_prompt_lookup"
VLLM_PROMPT_LOOKUP_FIXED = "vllm_prompt_lookup_fixed"
VLLM_LOOKAHEAD = "vllm_lookahead"
VLLM_MEDUSA = "vllm_medusa"
VLLM_SUFFIX = "vllm_suffix"
VLLM_HASTEN_SUFFIX = "vllm_hasten_suffix"
VLLM_HASTEN_SUFFIX_FIXED = "vllm_hasten_suffix_fixed"
BASELINES = (VLLM, VLLM_NGRAM, VLLM_PROMPT_LOOKUP, VLLM_PROMPT_LOOKUP_FIXED, VLLM_LOOKAHEAD, VLLM_MEDUSA, VLLM_SUFFIX,
             VLLM_HASTEN_SUFFIX, VLLM_HASTEN_SUFFIX_FIXED)
# not in --baselines auto: medusa needs trained heads and writes an export; vLLM's suffix method needs
# arctic-inference in vLLM's environment; the fixed-depth, lookahead and suffix proposers are comparisons
# for those who ask (each baseline is one more vLLM engine to load)
ON_REQUEST = (VLLM_PROMPT_LOOKUP_FIXED, VLLM_LOOKAHEAD, VLLM_MEDUSA, VLLM_SUFFIX, VLLM_HASTEN_SUFFIX,
              VLLM_HASTEN_SUFFIX_FIXED)
# each baseline's speculative_config (None: plain decoding)
SPECULATIVE = {
    VLLM: None,
    VLLM_NGRAM: {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    VLLM_PROMPT_LOOKUP: {"method": "custom_class", "model": "hasten.vllm.PromptLookup", "num_speculative_tokens": 10},
    VLLM_PROMPT_LOOKUP_FIXED: {"method": "custom_class", "model": "hasten.vllm.FixedPromptLookup",
                               "num_speculative_tokens": 5},
    VLLM_LOOKAHEAD: {"method": "custom_class", "model": "hasten.vllm.Lookahead", "num_speculative_tokens": 10},
    # SuffixDecoding: vLLM's own (arctic-inference's trees, vLLM's defaults: up to 24 tokens) and hasten's
    # port through hasten.vllm, sized per request or, like vLLM's, always as deep as the match allows
    VLLM_SUFFIX: {"method": "suffix", "num_speculative_tokens": 24},
    VLLM_HASTEN_SUFFIX: {"method": "custom_class", "model": "hasten.vllm.Suffix", "num_speculative_tokens": 24},
    VLLM_HASTEN_SUFFIX_FIXED: {"method": "custom_class", "model": "hasten.vllm.FixedSuffix",
                               "num_speculative_tokens": 24},
}
ENV_PYTHON = "HASTEN_VLLM_PYTHON"
DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
MARK = "@@hasten "  # the worker's protocol lines (vllm_worker.MARK)
INSTALL = "run `make vllm` (vLLM's CPU build in its own .venv-vllm) or set HASTEN_VLLM_PYTHON to its python"


def vllm_python() -> Path | None:
    """The Python of vLLM's environment: $HASTEN_VLLM_PYTHON, else ./.venv-vllm/bin/python."""
    given = os.environ.get(ENV_PYTHON)
    path = Path(given) if given else DEFAULT_PYTHON
    return path if path.exists() else None


def thread_binding(threads: int) -> dict[str, str]:
    """vLLM's CPU worker binds its OpenMP threads to cores itself (by default all but one):
    ``threads`` cores from core 0, none reserved (0 = all cores)."""
    count = threads or os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{count - 1}" if count > 1 else "0",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": str(count)}


class Worker:
    """One vLLM engine in its own process, answering one prompt at a time."""

    def __init__(self, python: Path, settings: dict, threads: int):
        env = {**os.environ, **thread_binding(threads)}
        self.log = tempfile.TemporaryFile("w+")  # vLLM logs plenty: a file, so no pipe ever fills up
        # -P: the worker's own folder (hasten.bench) must not shadow vLLM's imports
        self.process = subprocess.Popen([str(python), "-P", str(WORKER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.ready = self.ask(settings)

    def ask(self, message: dict) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        self.log.seek(0)
        last = self.log.read()[-3000:]
        self.close()
        raise UserError(f"the vLLM worker stopped without an answer; its last output:\n{last}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("\n")
            self.process.stdin.flush()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def model_directory(model) -> str:
    """The directory vLLM loads: the one the PyTorch model came from."""
    path = getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "")
    if not path or not Path(path, "config.json").exists():
        raise UserError(f"the vLLM baselines need the model as a local directory with config.json; "
                        f"this model came from {path or 'memory'!r}")
    return str(Path(path).resolve())


def exported_medusa(model) -> tuple[dict, Callable[[], None]]:
    """hasten's trained Medusa heads for ``model`` in vLLM's layout, in a temporary folder: the
    speculative_config that loads them, and what removes the folder."""
    from ..drafters.medusa import Medusa
    from ..export import medusa_for_vllm, write

    heads = Medusa(require_weights=True).find_module(model)  # MissingWeights says how to train them
    folder = tempfile.TemporaryDirectory(prefix="hasten-vllm-medusa-")
    write(medusa_for_vllm(heads, model.get_output_embeddings().weight, model.dtype), folder.name)
    config = {"method": "medusa", "model": folder.name, "num_speculative_tokens": heads.config.num_heads}
    return config, folder.cleanup


def arctic_inference_in(python: Path) -> bool:
    """Whether vLLM's environment imports arctic-inference's suffix decoding (vLLM's ``suffix``)."""
    found = subprocess.run([str(python), "-P", "-c", "import arctic_inference.suffix_decoding"],
                           capture_output=True, timeout=60)
    return found.returncode == 0


def baseline_method(name: str, model, max_model_len: int, threads: int) -> Method:
    """A vLLM baseline on the directory ``model`` was loaded from, in its dtype."""
    if name not in BASELINES:
        raise ValueError(f"unknown vLLM baseline {name!r}; known: {', '.join(BASELINES)}")
    python = vllm_python()
    if python is None:
        raise UserError(f"the {name} baseline needs vLLM: {INSTALL}")
    if name == VLLM_SUFFIX and not arctic_inference_in(python):  # vLLM's own hint names a version that is not 0.3.0
        raise UserError(f"the {name} baseline (vLLM's own suffix decoding) imports arctic-inference, which is not "
                        f"in vLLM's environment ({python}): run `make vllm-suffix`, which builds it there")
    if is_quantized(model):  # its outputs would be another model's than the one hasten runs
        raise ValueError(f"the {name} baseline runs the checkpoint's own weights, not hasten's int8 layers: "
                         "time it without --dtype int8")
    dtype = str(model.dtype).removeprefix("torch.")
    speculative, cleanup = exported_medusa(model) if name == VLLM_MEDUSA else (SPECULATIVE[name], None)
    settings = {"model": model_directory(model), "dtype": dtype, "max_model_len": max_model_len,
                "speculative": speculative}
    try:
        worker = Worker(python, settings, threads)
    except BaseException:
        if cleanup:
            cleanup()
        raise

    def run(input_ids: torch.Tensor, max_new_tokens: int):
        answer = worker.ask({"prompt": input_ids[0].tolist(), "max_tokens": max_new_tokens})
        tokens = answer["tokens"]
        # each forward yields one token plus the drafts it accepted
        steps = max(1, len(tokens) - answer["accepted"])
        per_position = answer.get("accepted_per_position") or []
        drafts = answer.get("drafts", 0)
        stats = DecodeStats(steps=steps, new_tokens=len(tokens), accepted_tokens=answer["accepted"],
                            drafted_tokens=drafts * len(per_position),
                            drafted_at_depth=[drafts] * len(per_position) if drafts else [],
                            accepted_at_depth=per_position if drafts else [])
        return tokens, stats, answer["seconds"]

    def close() -> None:
        worker.close()
        if cleanup:
            cleanup()

    recorded = {"vllm": worker.ready.get("vllm"), "dtype": dtype, "threads": threads or os.cpu_count(),
                "enforce_eager": True, "prefix_caching": False,
                "speculative_config": {**speculative, "model": "(hasten's medusa, exported)"}
                if name == VLLM_MEDUSA else speculative}
    return Method(name, "vllm", run, recorded, exact=False, close=close)
