"""``hasten dlm bench``: speed against quality of every diffusion-LM policy on ``zoo:dlm-tiny``.

Task: held-out function completion (``tasks.py``): the prompt is a held-out stdlib file up to the end
of a function's docstring (or first statement), the reference the rest of that function, at most
``gen_length`` tokens so that the generation can cover it; the completion is trimmed where the
function ends by indentation. For every setting, against ``NoCache`` on the same prompts in the
same run (settings run one after another for each prompt, so load drifts hit all of them alike):

* ``speedup``: total wall time of ``NoCache`` / total wall time of the setting;
* ``token_forward_ratio``: positions run through the model / positions ``NoCache`` runs;
* ``agreement``: fraction of generated tokens equal to ``NoCache``'s at the same position (NoCache run with
  the same remasking rule: the first setting of each rule is its reference);
* ``reference_match``: fraction of the reference's tokens generated at their position;
* ``exact``: fraction of completions equal to the reference once trimmed;
* ``parses``: fraction of completions whose completed function ``ast.parse`` accepts;
* ``judge_nll``: mean negative log-likelihood of the generated tokens under ``zoo:code-tiny`` (an
  autoregressive judge: lower reads more like real code).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..zoo import WEIGHTS_DIR, corpus
from ..zoo.packing import unpacked
from .heldout import SOURCES as HELDOUT
from .policies import DKVCache, FastDLLMDual, FastDLLMPrefix, NoCache, describe
from .sampler import generate
from .sparse import SparseD
from .tasks import completes_function, exact_match
from .tasks import completion_tasks as function_tasks

DLM_WEIGHTS = WEIGHTS_DIR / "dlm-tiny"
JUDGE_WEIGHTS = WEIGHTS_DIR / "code-tiny"


@dataclass(frozen=True)
class Setting:
    """A policy plus the parallel-decoding threshold and the remasking rule it runs with."""

    policy: object
    threshold: float | None = None
    remasking: str = "low_confidence"

    @property
    def label(self) -> str:
        return describe(self.policy) + ("" if self.threshold is None else f" + threshold {self.threshold:g}") + \
            ("" if self.remasking == "low_confidence" else f" + {self.remasking}")


# dKV-Cache-Greedy as the reference runs it: the order drawn at the block's start, its README's command line
# (--cache-steps 2 --window-size 4), against NoCache with the same order
GREEDY = [Setting(NoCache(), remasking="random_order"),
          Setting(DKVCache(variant="greedy", cache_reloading_step=2, window=4), remasking="random_order")]
# hasten's earlier dKV-Cache default (one cache, no reloading) and its neighbourhood knob on that schedule
WHOLE_GENERATION = [Setting(DKVCache(schedule="whole_generation", cache_reloading_step=None)),
                    Setting(DKVCache(schedule="whole_generation", cache_reloading_step=None, fresh_before_block=16))]


def default_settings() -> list[Setting]:
    return [
        Setting(NoCache()),
        Setting(DKVCache()),  # the reference's schedule, cache_reloading_step 8 (its README's LLaDA example)
        Setting(DKVCache(cache_reloading_step=2)),  # llada_generate.py's default
        Setting(DKVCache(fresh_before_block=16)),  # + hasten's neighbourhood knob
        *WHOLE_GENERATION,
        Setting(DKVCache(variant="prefill")),
        Setting(SparseD()),  # the reference's short-context preset: select 0.5, block 32
        Setting(SparseD(select=0.3, block=32)),
        Setting(SparseD(selection="single")),  # hasten's earlier selection, for comparison
        Setting(FastDLLMPrefix()),
        Setting(FastDLLMDual()),
        Setting(SparseD(select=0.3, block=32, cache=DKVCache())),
        Setting(SparseD(select=0.3, block=32, cache=FastDLLMDual())),
        Setting(NoCache(), threshold=0.9),
        Setting(FastDLLMDual(), threshold=0.9),
        Setting(DKVCache(), threshold=0.9),
        *GREEDY,
    ]


def long_context_settings() -> list[Setting]:
    return [Setting(NoCache()), Setting(SparseD()), Setting(SparseD(selection="single")),
            Setting(SparseD(select=0.3, block=64)), Setting(SparseD(select=0.3, block=64, selection="single")),
            Setting(DKVCache()), Setting(DKVCache(fresh_before_block=32)), Setting(FastDLLMDual()),
            # on a cache, SparseD blocks of 32 line up with the generation blocks, so a block's queries fill one tile
            Setting(SparseD(select=0.3, block=32, cache=DKVCache()))]


def heldout_settings() -> list[Setting]:
    """The settings of the held-out agreement check (docs/dlm.md): dKV-Cache by the reference's schedule and with
    hasten's knobs, SparseD's isolated selection against hasten's earlier single top-k."""
    return [Setting(NoCache()), Setting(DKVCache()), Setting(DKVCache(cache_reloading_step=2)),
            Setting(DKVCache(fresh_before_block=16)), *WHOLE_GENERATION,
            Setting(SparseD()), Setting(SparseD(selection="single")),
            Setting(SparseD(select=0.3, block=32)), Setting(SparseD(select=0.3, block=32, selection="single"))]


def heldout_long_settings() -> list[Setting]:
    return [Setting(NoCache()), Setting(DKVCache()), Setting(DKVCache(fresh_before_block=32)),
            Setting(SparseD(select=0.3, block=64)), Setting(SparseD(select=0.3, block=64, selection="single"))]


def load_models(weights: Path = DLM_WEIGHTS, judge: Path = JUDGE_WEIGHTS):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights, judge = unpacked(weights), unpacked(judge)  # the zoo ships them packed
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32, attn_implementation="sdpa").eval()
    judge_model = AutoModelForCausalLM.from_pretrained(judge, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(weights), judge_model


def completion_tasks(tokenizer, samples: int, prompt_length: int, gen_length: int, seed: int = 0) -> list[dict]:
    """Held-out function completions (see ``tasks.completion_tasks``) from the zoo corpus's held-out files."""
    return function_tasks(tokenizer, corpus.heldout_files(), samples, prompt_length, gen_length, seed,
                          read=corpus.read_text)


def heldout_tasks(tokenizer, samples: int, prompt_length: int, gen_length: int, seed: int = 0) -> list[dict]:
    """Function completions from the held-out modules of ``heldout.py``, written for the agreement check."""
    return function_tasks(tokenizer, list(HELDOUT), samples, prompt_length, gen_length, seed, read=HELDOUT.get)


@torch.no_grad()
def judge_nll(judge, prompt: torch.Tensor, generated: torch.Tensor) -> float:
    """Mean NLL of ``generated`` [gen] after ``prompt`` [1, T] under the autoregressive judge."""
    vocab = judge.config.vocab_size
    sequence = torch.cat([prompt[0], generated]).clamp(max=vocab - 1)[None]  # an out-of-vocabulary id reads as the last
    logits = judge(input_ids=sequence).logits[0, prompt.shape[1] - 1:-1]  # [gen, vocab]
    return float(torch.nn.functional.cross_entropy(logits.float(), sequence[0, prompt.shape[1]:]))


def run_settings(model, judge, tasks: list[dict], settings: list[Setting], gen_length: int, block_length: int,
                 steps: int, decode, progress: bool = True) -> dict:
    """Every setting on every task; the first setting is the speed reference (NoCache) and the first of each
    remasking rule its agreement reference. ``decode``: token ids (a list) -> text, to trim and parse the
    completions. Random remasking draws from a generator seeded 0 afresh for every run."""
    per_setting = [{"seconds": 0.0, "tokens": 0, "full_tokens": 0, "forwards": 0, "steps": 0, "agree": 0,
                    "match": 0, "exact": 0, "parses": 0, "nll": 0.0, "flops": 0, "flops_skipped": 0}
                   for _ in settings]
    for task in tqdm(tasks, desc="prompts", disable=not progress):
        prompt_length = task["prompt"].shape[1]
        reference_outputs = {}  # remasking rule -> NoCache's generated tokens
        for setting, acc in zip(settings, per_setting):
            out = generate(model, task["prompt"], gen_length=gen_length, block_length=block_length, steps=steps,
                           cache=setting.policy, threshold=setting.threshold, remasking=setting.remasking,
                           generator=torch.Generator().manual_seed(0))
            generated = out.sequences[0, prompt_length:]
            reference_output = reference_outputs.setdefault(setting.remasking, generated)
            s = out.stats
            acc["seconds"] += s.seconds
            acc["tokens"] += s.tokens_recomputed
            acc["full_tokens"] += s.tokens_full
            acc["forwards"] += s.forwards
            acc["steps"] += s.steps
            acc["flops"] += s.attention_flops
            acc["flops_skipped"] += s.attention_flops_skipped
            acc["agree"] += int((generated == reference_output).sum())
            reference = task["reference"]  # [n <= gen_length]
            acc["match"] += int((generated[:len(reference)] == reference).sum())
            completion = decode(generated.tolist())
            acc["exact"] += exact_match(task["head"], completion, task["reference_text"])
            acc["parses"] += completes_function(task["head"], completion)
            acc["nll"] += judge_nll(judge, task["prompt"], generated)
    base = per_setting[0]
    total = gen_length * len(tasks)
    reference_total = sum(len(task["reference"]) for task in tasks)
    results = []
    for setting, acc in zip(settings, per_setting):
        results.append({
            "setting": setting.label, "policy": type(setting.policy).__name__, "threshold": setting.threshold,
            "speedup": base["seconds"] / acc["seconds"], "seconds": acc["seconds"],
            "token_forward_ratio": acc["tokens"] / base["tokens"], "forwards": acc["forwards"],
            "steps": acc["steps"], "attention_flops_skipped_fraction": acc["flops_skipped"] / base["flops"],
            "agreement": acc["agree"] / total, "reference_match": acc["match"] / reference_total,
            "exact": acc["exact"] / len(tasks), "parses": acc["parses"] / len(tasks),
            "judge_nll": acc["nll"] / len(tasks),
        })
    return {"prompts": len(tasks), "prompt_length": tasks[0]["prompt"].shape[1], "gen_length": gen_length,
            "block_length": block_length, "steps": steps, "files": [t["file"] for t in tasks], "results": results}


def markdown(report: dict) -> str:
    lines = []
    for key in ("main", "long"):
        section = report.get(key)
        if not section:
            continue
        lines += [f"### {key} context: {section['prompts']} prompts of {section['prompt_length']} tokens, "
                  f"{section['gen_length']} generated, blocks of {section['block_length']}, {section['steps']} steps",
                  "", "| setting | speedup | token-forwards | attention FLOPs skipped | steps | agreement with NoCache "
                  "| reference match | exact | parses | judge NLL |", "|---" + "|---:" * 9 + "|"]
        for r in section["results"]:
            lines.append(f"| {r['setting']} | {r['speedup']:.2f}x | {r['token_forward_ratio']:.2f} "
                         f"| {r['attention_flops_skipped_fraction']:.0%} | {r['steps']} | {r['agreement']:.1%} "
                         f"| {r['reference_match']:.1%} | {r['exact']:.0%} | {r['parses']:.0%} "
                         f"| {r['judge_nll']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def chart(report: dict, path: Path) -> None:
    """Speedup against agreement with NoCache, one point per setting (and context)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for key, marker in (("main", "o"), ("long", "s")):
        section = report.get(key)
        if not section:
            continue
        for r in section["results"]:
            ax.scatter(r["agreement"], r["speedup"], marker=marker)
            ax.annotate(f"{r['setting']} [{key}]", (r["agreement"], r["speedup"]), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("token agreement with NoCache")
    ax.set_ylabel("speedup over NoCache (wall time)")
    ax.set_title("hasten dlm bench: zoo:dlm-tiny, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
