"""``hasten bench --backend llama.cpp``: hasten's methods on a GGUF model run by llama.cpp,
timed against llama.cpp's own decoding of the same file in the same interleaved run.

hasten's side is the runner's own hasten methods over a
:class:`~hasten.models.llamacpp.LlamaCppModel` (the loop opens a llama.cpp target for it):
their reference is hasten's plain decoding on that backend. The baselines are
llama-cpp-python's ``Llama`` generation loops on the same file, context size and threads:

* ``llama_cpp``: its plain greedy decoding (the prompt in one batch, then one token a step);
* ``llama_cpp_noflash``: the same loop with flash attention off, llama-cpp-python's own default;
* ``llama_cpp_lookup``: the plain loop with its prompt-lookup draft model
  (``LlamaPromptLookupDecoding``), where this llama-cpp-python has it.

``llama_cpp`` and ``llama_cpp_lookup`` run with flash attention on, as the backend does, so their
greedy tokens equal hasten's (tests/test_llamacpp.py): they are the backend's reference, and the
runner checks that on every prompt. Without flash attention llama.cpp rounds otherwise and may
write other text (docs/cpu.md, "Exactness"), so ``llama_cpp_noflash`` is timed for its speed
alone: its outputs are compared and counted (the ``identical`` column), not required equal.
"""
from __future__ import annotations

import itertools
import time

import torch

from ..api import AUTOREGRESSIVE
from ..loading import gguf_source
from ..core.stats import DecodeStats
from ..drafters.base import REGISTRY
from ..models.llamacpp import LlamaCppModel, llama_cpp_module
from .runner import LLAMA_CPP, LLAMA_CPP_NOFLASH, Method

LLAMA_CPP_LOOKUP = "llama_cpp_lookup"
BASELINES = (LLAMA_CPP, LLAMA_CPP_NOFLASH, LLAMA_CPP_LOOKUP)
FLASH_ATTENTION_OFF = frozenset({LLAMA_CPP_NOFLASH})  # the baselines run as llama-cpp-python runs by default
LOOKUP_TOKENS = 10  # llama-cpp-python's own default for LlamaPromptLookupDecoding
# The methods --methods auto times on this backend: the training-free drafters (plus
# draft_model when a GGUF draft is given). Trained drafters read the target's features,
# which llama.cpp does not expose.
AUTO_METHODS = (AUTOREGRESSIVE, "prompt_lookup", "lookahead", "draft_model")
CONTEXT_STEP = 256  # contexts are sized to the longest prompt and budget, rounded up to this
SECOND_TURN_ROOM = 512  # positions a context keeps for an MT-bench second question and its template


def context_for(input_ids: list[torch.Tensor], max_new_tokens: int) -> int:
    """Positions enough for the longest prompt, its new tokens and one draft block past them."""
    longest = max(ids.shape[1] for ids in input_ids) + max_new_tokens + 64
    return -(-longest // CONTEXT_STEP) * CONTEXT_STEP


def load(name, threads: int, context: int) -> LlamaCppModel:
    return LlamaCppModel(gguf_source(name), threads=threads, context=context)


def method_names(names: list[str], draft_given: bool, auto: bool) -> list[str]:
    """The hasten methods to time on llama.cpp: with ``auto`` the training-free ones that the
    given models allow; otherwise ``names``, each checked to run on this backend."""
    if auto:
        return [n for n in AUTO_METHODS if draft_given or not REGISTRY.get(n) or not REGISTRY[n].needs_draft_model]
    for name in names:
        if name in REGISTRY:
            REGISTRY[name].check_runtime(LlamaCppModel)  # what llama.cpp declares, before loading a file
    return names


def lookup_available() -> bool:
    """Whether this llama-cpp-python has its prompt-lookup draft model."""
    try:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except ImportError:
        return False
    return True


def baseline_method(name: str, model: LlamaCppModel) -> Method:
    """llama-cpp-python's own greedy loop on the model's file, context and threads; with flash
    attention on (the backend's reference, checked equal) but for :data:`FLASH_ATTENTION_OFF`
    (timed, its outputs counted)."""
    if name not in BASELINES:
        raise ValueError(f"unknown llama.cpp baseline {name!r}; known: {', '.join(BASELINES)}")
    llama_cpp_module()  # the install hint, if it is missing
    from llama_cpp import Llama

    options = {}
    if name == LLAMA_CPP_LOOKUP:
        if not lookup_available():
            raise ValueError("this llama-cpp-python has no LlamaPromptLookupDecoding")
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        options["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    # flash attention as the backend runs it (its greedy tokens then equal hasten's), unless this
    # baseline is llama-cpp-python's default; n_batch as the backend feeds the prompt
    flash_attn = name not in FLASH_ATTENTION_OFF
    llm = Llama(str(model.path), n_ctx=model.context, n_batch=model.n_batch, n_ubatch=model.n_batch,
                n_threads=model.threads, n_threads_batch=model.threads, flash_attn=flash_attn, verbose=False,
                **options)
    counting = _count_evals(llm)

    def run(input_ids, max_new_tokens):
        prompt = input_ids[0].tolist()
        llm.reset()  # no reuse of the previous run's cache: every run prefills its prompt
        counting.clear()
        clock = time.perf_counter()
        # repeat_penalty 1.0: plain greedy (llama-cpp-python's generate applies none by default either)
        new = list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), max_new_tokens))
        seconds = time.perf_counter() - clock
        # every eval is a step, the prompt's too (it yields the first token), as the runner counts Hugging Face's
        return new, DecodeStats(steps=len(counting), new_tokens=len(new)), seconds

    settings = {"flash_attn": flash_attn, "n_ctx": model.context, "threads": model.threads}
    if name == LLAMA_CPP_LOOKUP:
        settings["num_pred_tokens"] = LOOKUP_TOKENS
    return Method(name, "llama.cpp", run, settings, exact=flash_attn)


def _count_evals(llm) -> list:
    """Wrap ``llm.eval`` to count its calls (the target forwards, for tau)."""
    calls: list = []
    evaluate = llm.eval

    def counted(tokens):
        calls.append(len(tokens))
        return evaluate(tokens)

    llm.eval = counted
    return calls
