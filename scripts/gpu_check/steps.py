"""What the GPU check runs, each step a command with its own time box: at full size on a GPU
machine, or (``--dry-run``) the same commands at tiny sizes on this CPU."""
from __future__ import annotations

import json
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"  # hasten.zoo.real's name for it: its shipped drafters are found
REAL_MODEL = "{real_model}"  # filled in once the model's parts are assembled


@dataclass(frozen=True)
class Step:
    name: str
    what: str  # one line for the report
    command: tuple[str, ...]
    box_s: float  # killed (and reported "timed out") past this many seconds
    env: dict = field(default_factory=dict)
    needs_real_model: bool = False  # waits for SmolLM2's parts (GPU run only)
    results: str | None = None  # what the step writes for the report: a junit xml, a bench folder, a training.json
    kind: str = "command"  # environment, pytest, bench, training


@dataclass(frozen=True)
class Sizes:
    device: str
    dtype: str
    cuda_tests: tuple[str, ...]  # pytest ids and options: their CUDA cases skip without a GPU
    greedy: tuple[str, ...]  # the greedy-equality suite, its models and prompts on ``device``
    sampling_law: tuple[str, ...]  # the end-to-end sampling-law tests, likewise
    real_model: str | None  # None: SmolLM2 assembled from its parts
    chat_tasks: tuple[str, ...]  # hasten bench --tasks ... --per-task ...
    chat_tokens: int
    long_prompts: tuple[str, ...]  # hasten bench --tasks ..., or --prompts FILE ("{work}": the work folder)
    long_what: str
    long_tokens: int
    training: tuple[str, ...]  # hasten train eagle's data and budget flags
    boxes: dict[str, float]


# docs/long-context.md's settings (TriForce's draft is zoo:code-tiny-draft)
LONG_SETTINGS = ("--method-arg", "triforce.budget=512", "--method-arg", "longspec.depth=4",
                 "--method-arg", "longspec.top_k=2", "--method-arg", "longspec.total_tokens=6")
CUDA_TESTS = ("tests/test_verify_device.py", "tests/test_easyspec.py::test_streams_on_cuda_keep_the_output")
# the row-invariant Triton kernels and the models on them (on the GPU), and hasten's CPU kernels on
# this machine's processor against the development machine's bits (docs/fidelity.md, "Precision")
INVARIANCE_TESTS = ("tests/test_invariant_cuda.py",
                    "tests/test_invariant.py::test_every_instruction_path_gives_the_same_bits")
GPU = Sizes(
    device="cuda", dtype="bfloat16", cuda_tests=CUDA_TESTS,
    greedy=("tests/test_greedy_equality.py",),
    # the law of every kind of draft; the two tests that break the verifier on purpose (the
    # bound's power, nothing about the device) stay on the CPU
    sampling_law=tuple(f"tests/test_sampling_distribution.py::{name}" for name in (
        "test_draft_model_3_deep_follows_the_target", "test_tree_with_siblings_at_depths_1_to_3_follows_the_target",
        "test_plain_and_input_guided_sampling_follow_the_target", "test_same_seed_same_sample")),
    real_model=None, chat_tasks=("--tasks", "spec-bench", "--per-task", "1"), chat_tokens=64,
    long_prompts=("--tasks", "long16k"), long_what="16,000-token prompts (long16k)", long_tokens=128,
    training=("--pydoc-topics", "--chat", "--samples", "40", "--prompt-tokens", "128", "--gen-tokens", "96",
              "--minutes", "1", "--batch-size", "16"),
    # 410 s for the first command's steps, 390 s for the last's. On the H100 of 2026-11-26, 7 methods
    # x 7 prompts x 128 tokens of SmolLM2 did not fit in 250 s, so the bench asks 64 tokens
    # (docs/gpu.md, "The first GPU run")
    boxes={"environment": 20, "invariance-on-device": 120, "cuda-tests": 60, "greedy-on-device": 60,
           "sampling-law-on-device": 150, "long-context": 120, "real-model-bench": 240, "drafter-training": 150},
)
DRY = Sizes(
    device="cpu", dtype="float32", cuda_tests=CUDA_TESTS + ("-k", "cuda"),  # the CPU cases run in make test
    greedy=("tests/test_greedy_equality.py::test_plain_decoding[llama]",),
    sampling_law=("tests/test_sampling_distribution.py::test_same_seed_same_sample",),
    real_model="zoo:code-tiny", chat_tasks=("--tasks", "complete", "--per-task", "1"), chat_tokens=8,
    long_prompts=("--prompts", "{work}/long-prompt.jsonl"), long_what="a 1,500-token prompt", long_tokens=8,
    training=("--zoo-corpus", "--samples", "4", "--prompt-tokens", "16", "--gen-tokens", "8", "--steps", "2",
              "--batch-size", "2", "--threads", "1"),
    boxes={"environment": 60, "invariance-on-device": 60, "cuda-tests": 60, "greedy-on-device": 60,
           "sampling-law-on-device": 60, "long-context": 60, "real-model-bench": 60, "drafter-training": 60},
)


def plan(sizes: Sizes, python: str, out: Path, work: Path) -> list[Step]:
    """The steps, in order; the real model's path stays ``REAL_MODEL`` until it is assembled."""
    model = sizes.real_model or REAL_MODEL
    runtime = ("--device", sizes.device, "--dtype", sizes.dtype, "--repeats", "1", "--draft-size", "fixed",
               "--progress", "lines") + (("--count-differences",) if sizes.device != "cpu" else ())
    pytest = (python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs")
    hasten = (python, "-m", "hasten")
    steps = [
        Step("environment", "Python, torch, CUDA, the GPU and the packages hasten reads",
             (python, str(ROOT / "scripts" / "gpu_check" / "environment.py"))
             + (("--require-cuda",) if sizes.device != "cpu" else ()), sizes.boxes["environment"], kind="environment"),
        Step("invariance-on-device", "the row-invariant Triton kernels and tiny models on them (a block's every "
             "position equals one-token steps, bit for bit), and the CPU kernels' bits on this machine's processor",
             pytest + ("--junitxml", str(work / "invariance-on-device.xml")) + INVARIANCE_TESTS,
             sizes.boxes["invariance-on-device"], results=str(work / "invariance-on-device.xml"), kind="pytest"),
        Step("cuda-tests", "the device verifier, the CUDA generator, host syncs per step, EasySpec's streams",
             pytest + ("--junitxml", str(work / "cuda-tests.xml")) + sizes.cuda_tests, sizes.boxes["cuda-tests"],
             results=str(work / "cuda-tests.xml"), kind="pytest"),
        suite("greedy-on-device", f"greedy output identical to Hugging Face's, tiny models on {sizes.device}",
              sizes.greedy, sizes, pytest, work),
        suite("sampling-law-on-device", f"sampled output follows the target's law, a tiny model on {sizes.device}",
              sizes.sampling_law, sizes, pytest, work),
        Step("long-context", f"TriForce and LongSpec vs plain decoding on zoo:code-tiny-long, {sizes.long_what}",
             hasten + ("bench", "--model", "zoo:code-tiny-long", "--draft", "zoo:code-tiny-draft",
                       "--methods", "autoregressive,triforce,longspec", *LONG_SETTINGS,
                       "--baselines", "none", *(p.format(work=work) for p in sizes.long_prompts), "--per-task", "1",
                       "--max-new-tokens", str(sizes.long_tokens), "--out", str(work / "long-context")) + runtime,
             sizes.boxes["long-context"], results=str(work / "long-context"), kind="bench"),
        Step("real-model-bench", "plain, HF greedy and prompt lookup, hasten's training-free methods and its shipped "
             "drafters on the real model",
             hasten + ("bench", "--model", model, "--methods", "autoregressive,prompt_lookup,lookahead,medusa,eagle",
                       "--baselines", "hf_generate,hf_prompt_lookup", *sizes.chat_tasks,
                       "--max-new-tokens", str(sizes.chat_tokens), "--out", str(work / "real-model-bench")) + runtime,
             sizes.boxes["real-model-bench"], needs_real_model=sizes.real_model is None,
             results=str(work / "real-model-bench"), kind="bench"),
        Step("drafter-training", "a short EAGLE training run for the real model: weights and held-out acceptance",
             hasten + ("train", "eagle", "--model", model, *sizes.training, "--device", sizes.device,
                       "--out", str(out / "eagle"), "--work-dir", str(work / "train-eagle")),
             sizes.boxes["drafter-training"], needs_real_model=sizes.real_model is None,
             results=str(out / "eagle"), kind="training"),
    ]
    # every step runs with the CUDA kernels on (models/invariant.py: opt-in until a GPU run checks them)
    return [Step(**{**step.__dict__, "env": {**step.env, "HASTEN_CUDA_INVARIANT": "1"}}) for step in steps]


def suite(name: str, what: str, tests: tuple[str, ...], sizes: Sizes, pytest: tuple[str, ...], work: Path) -> Step:
    """A pytest step whose tiny models and prompts live on ``sizes.device`` (tests/helpers.py)."""
    xml = str(work / f"{name}.xml")
    return Step(name, what, pytest + ("--junitxml", xml) + tests, sizes.boxes[name],
                env={"HASTEN_TEST_DEVICE": sizes.device}, results=xml, kind="pytest")


def write_long_prompt(work: Path, characters: int = 6000) -> Path:
    """The dry run's long prompt: the start of the stdlib's argparse.py (about 1,500 tokens of
    zoo:code-tiny-long's tokenizer), as a ``hasten bench --prompts`` file."""
    path = work / "long-prompt.jsonl"
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")[:characters]
    path.write_text(json.dumps({"prompt": text, "category": "long"}) + "\n")
    return path


def with_real_model(step: Step, path: Path) -> Step:
    return Step(**{**step.__dict__, "command": tuple(str(path) if part == REAL_MODEL else part for part in step.command)})
