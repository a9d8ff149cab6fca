"""Text in, text out: ``hasten.load`` and the :class:`Engine` it returns."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generator, Iterator

import torch
from transformers import PreTrainedModel

from .arguments import AUTO_DTYPE, resolve_dtype
from .drafters.base import REGISTRY, Drafter, create
from .engine.loop import decode
from .engine.calibration import load_or_calibrate
from .engine.planner import DraftPlanner
from .engine.requests import request_from
from .engine.sizing import SizingChoice, SizingRule
from .engine.stops import TextStream
from .engine.verify import acceptance_rule
from .loading import (
    INT8, optional_tokenizer, as_model, gguf_source, gguf_tokenizer, load_processor, load_tokenizer,
    warn_if_tokenizers_differ,
)
from .models import vlm
from .models.adapter import vocab_size
from .models.hf import runtime_of
from .core.constraint import compiled, start_mask
from .core.request import Request
from .core.runtime import Capability
from .core.generators import consume, mapped
from .core.pool import Pool
from .core.stats import DecodeStats
from .core.threads import DEFAULT_THREADS, stepped_in_threads, thread_count, using_threads

AUTOREGRESSIVE = "autoregressive"  # the plain baseline: the decode loop without a drafter
# what load, generate and serve run unless told otherwise: copying and a trained drafter's guesses in one
# tree (mixed) for a model whose EAGLE-3 weights are found, else copying alone (prompt_lookup)
DEFAULT_METHOD = "default"
PREDICTED, COPIED = "mixed", "prompt_lookup"  # what the default becomes, with and without trained weights
METHOD_HELP = (f"acceleration method (default: {PREDICTED} for a model with trained EAGLE-3 weights beside it or "
               f"shipped in the zoo, else {COPIED}; {AUTOREGRESSIVE} = plain decoding)")


def method_names() -> list[str]:
    """Every name ``method=`` / ``--method`` takes."""
    return [DEFAULT_METHOD, AUTOREGRESSIVE, *sorted(REGISTRY)]


def check_method(method: str, has_draft: bool, has_settings: bool = False) -> None:
    """Raise ValueError unless ``method`` exists and gets a draft model exactly when it
    needs one; cheap, so callers check it before loading any model."""
    if method == DEFAULT_METHOD:
        if has_settings:
            raise ValueError(f"method settings belong to a named method: name it (method= / --method; the default "
                             f"runs {PREDICTED} for a model with trained EAGLE-3 weights, else {COPIED})")
        method = COPIED  # a draft model is refused as the copier refuses it
    if method != AUTOREGRESSIVE and method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}; known: {', '.join(method_names())}")
    needs = method != AUTOREGRESSIVE and REGISTRY[method].needs_draft_model
    if needs and not has_draft:
        raise ValueError(f"method {method!r} needs a draft model: pass draft=PATH (--draft PATH)")
    if has_draft and not needs:
        takers = ", ".join(name for name, cls in sorted(REGISTRY.items()) if cls.needs_draft_model)
        raise ValueError(f"method {method!r} takes no draft model (draft= / --draft is for: {takers or 'none'})")


def default_method(model: PreTrainedModel) -> str:
    """What the default method is for ``model``: ``mixed`` when its mixed tree's predictor
    (EAGLE-3) has trained weights for it, beside it or shipped in the zoo, else ``prompt_lookup``
    (an untrained predictor would cost steps and rarely guess right)."""
    predictor = REGISTRY[PREDICTED].Settings.predictor
    if vlm.is_vision_language(model) or model.config.is_encoder_decoder:
        return COPIED  # mixed reads a decoder-only text model's features
    return PREDICTED if REGISTRY[predictor].weights_dir(model) is not None else COPIED


def make_drafter(method: str, draft_model: PreTrainedModel | None = None, **method_kwargs) -> Drafter | None:
    if method == AUTOREGRESSIVE and method_kwargs:
        raise TypeError(f"method {AUTOREGRESSIVE!r} takes no settings, got {sorted(method_kwargs)}")
    check_method(method, draft_model is not None)
    if method == AUTOREGRESSIVE:
        return None
    if draft_model is not None:  # check_method made sure the method needs it
        return create(method, model=draft_model, **method_kwargs)
    return create(method, **method_kwargs)


@dataclass
class EngineOutput:
    text: str  # the generated text only
    token_ids: list[int]  # the generated tokens only
    stats: DecodeStats
    finish_reason: str | None = None  # as the server names it: "stop" (EOS or a stop string) or "length"


class Engine:
    """A model, its tokenizer and one acceleration method, ready to generate text.

    Plain prompts and chats share one path: text (:meth:`encode`) or messages
    (:meth:`encode_chat`) become input ids, and :meth:`steps` turns input ids into text.
    """

    def __init__(self, model: PreTrainedModel, tokenizer, drafter: Drafter | None, method: str,
                 draft_size: str | SizingRule | None = None, processor=None, threads: int | None = DEFAULT_THREADS,
                 name: str | None = None):
        self.model, self.tokenizer, self.drafter, self.method = model, tokenizer, drafter, method
        thread_count(threads)  # a bad value fails here, not at the first generation
        self.threads = threads  # torch's threads while this engine computes (hasten.core.threads)
        self.runtime = runtime_of(model)
        # what the user called the model (a zoo name, not the cache directory it resolves to), for messages
        self.name = name or self.runtime.label
        self.processor = processor  # a vision-language model's: text + images -> its inputs
        self.draft_size = draft_size
        self.planner = DraftPlanner(draft_size)  # a bad value fails here, not at the first generation

    # ---- plain text prompts ----------------------------------------------------------------
    def generate(self, prompt: str, **kwargs) -> EngineOutput:
        """Generate after ``prompt``; keywords: max_new_tokens, temperature, top_k, top_p, seed, stop,
        and images (a vision-language model's image paths or images; see :meth:`encode_images`)."""
        return self.collect(self._text(prompt), **kwargs)

    def stream(self, prompt: str, **kwargs) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (same keywords as :meth:`generate`)."""
        return self._pieces(self._text(prompt), kwargs)

    def generate_batch(self, prompts: list[str], *, max_new_tokens: int = 128, temperature: float = 0.0,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                       stop: str | list[str] | None = None, max_batch: int | None = None, constraint=None,
                       **rules) -> list[EngineOutput]:
        """Several prompts decoded together (continuous batching, one target forward per step
        for all rows), each exactly as :meth:`generate` would alone; ``seed`` seeds row i with
        ``seed + i``. ``max_batch`` rows run at once (default: all). ``constraint``: as in
        :meth:`steps`, for every row."""
        from .engine.batch import Scheduler

        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings")
        constraint = self.constraint(constraint)  # compiled once, shared by every row
        scheduler = Scheduler(self.runtime, self.drafter, max_batch=max_batch or len(prompts),
                              draft_size=self.draft_size)
        rows = {}
        for i, prompt in enumerate(prompts):
            request = self.request(self.encode(prompt), max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=None if seed is None else seed + i, stop=stop,
                                   constraint=constraint, **rules)
            rows[scheduler.submit(request)] = i
        outputs = [None] * len(prompts)
        with using_threads(self.threads):
            results = scheduler.run()
        for row_id, result in results.items():
            stream = TextStream(self.tokenizer, request.stop)
            text = stream.push(result.tokens) + stream.finish()
            outputs[rows[row_id]] = EngineOutput(text, stream.token_ids, result.stats, result.finish_reason)
        return outputs

    # ---- what the drafter learns across requests ------------------------------------------
    @property
    def pool(self) -> Pool | None:
        """The pool every generation of this engine drafts from and adds to (lookahead, suffix:
        :mod:`hasten.core.pool`), or None: the method learns nothing across requests."""
        return None if self.drafter is None else self.drafter.pool

    def open_pool(self, path: str | os.PathLike) -> Pool:
        """The shared pool, loaded from the file at ``path`` where one exists (its later
        :meth:`~hasten.core.pool.Pool.save` writes it there). ValueError: the method has no
        pool, or the file is not a saved pool of its kind."""
        if self.pool is None:
            raise ValueError(f"a pool file needs a method that learns across requests (lookahead or suffix), "
                             f"not {self.method}")
        if os.path.exists(path):
            self.pool.load(path)
        return self.pool

    # ---- chats -----------------------------------------------------------------------------
    def chat(self, messages: list[dict], **kwargs) -> EngineOutput:
        """The assistant's reply to ``messages`` (``[{"role": "user", "content": "..."}, ...]``),
        formatted by the tokenizer's chat template; same keywords as :meth:`generate`. As in
        Hugging Face ``generate``, the generation config's EOS ids end the reply. A
        vision-language model's chat may hold images (see :meth:`encode_chat_images`):
        ``{"type": "image"}`` entries in a content list, their images given by ``images=``."""
        return self.collect(self._chat_prompt(messages, kwargs), **kwargs)

    def chat_stream(self, messages: list[dict], **kwargs) -> Iterator[str]:
        """:meth:`chat`, yielding text pieces as tokens are accepted."""
        return self._pieces(self._chat_prompt(messages, kwargs), kwargs)

    def _chat_prompt(self, messages, kwargs: dict) -> torch.Tensor | tuple[torch.Tensor, dict]:
        """The chat's input ids, with its image inputs where it holds images (``images`` is
        taken out of ``kwargs``: the encoded prompt carries them)."""
        images = kwargs.pop("images", None)
        if images is None and not _has_image_entries(messages):
            return self.encode_chat(messages)
        return self.encode_chat_images(messages, images)

    # ---- text -> input ids -----------------------------------------------------------------
    def encode(self, prompt: str) -> torch.Tensor:
        """A plain prompt's ids [1, T], with whatever special tokens (BOS) the tokenizer adds."""
        return self.tokenizer(self._text(prompt), return_tensors="pt").input_ids  # [1, T]

    def encode_images(self, prompt: str, images: list) -> tuple[torch.Tensor, dict]:
        """A vision-language prompt: ids [1, T] with the image placeholders written out, and
        the processor's tensors (``pixel_values``, ...) for the prefill. ``images``: paths or
        images; a prompt without the image token gets one per image in front."""
        self._check_vision()
        return vlm.processor_inputs(self.processor, self._text(prompt), images)

    def encode_chat_images(self, messages: list[dict], images: list | None = None) -> tuple[torch.Tensor, dict]:
        """A vision-language chat through the processor's chat template, the assistant's turn
        opened: ids [1, T] with the image placeholders written out, and the processor's
        tensors for the prefill, as Hugging Face's ``processor.apply_chat_template`` gives
        them. A content is a str or a list of ``{"type": "text", "text": ...}`` and
        ``{"type": "image"}`` entries; an image entry takes its own ``"image"`` (a path or an
        image), else the next of ``images`` (paths or images)."""
        self._check_vision()
        return vlm.chat_inputs(self.processor, messages, images)

    def _check_vision(self) -> None:
        if Capability.IMAGES not in self.runtime.capabilities:
            raise ValueError(f"images given, but {self.name} is a text-only model")
        if self.processor is None:
            raise ValueError("images need the model's processor: load(model, processor=...)")

    @staticmethod
    def _text(prompt) -> str:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty")
        return prompt

    def encode_chat(self, messages: list[dict[str, str]], tools: list[dict] | None = None) -> torch.Tensor:
        """``messages`` through the chat template with the assistant's turn opened, as ids
        [1, T]. Tokenized as Hugging Face's ``apply_chat_template`` does: the template writes
        its own BOS where the model wants one, so the tokenizer must not add another."""
        from jinja2.exceptions import TemplateError  # transformers' chat templates are jinja

        vlm.check_messages(messages, entries_ok=False)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                "this model's tokenizer has no chat template, so it cannot format chat messages: "
                "send plain text instead (generate(prompt), or hasten generate without --chat)"
            )
        try:
            encoded = self.tokenizer.apply_chat_template(  # tools: for a template that shows them to the model
                messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
                **({"tools": tools} if tools else {}),
            )
        except TemplateError as err:  # the template's own check, e.g. "roles must alternate"
            raise ValueError(f"the chat template refused these messages: {err}") from err
        return encoded["input_ids"]  # [1, T]

    # ---- input ids -> text -----------------------------------------------------------------
    def collect(self, prompt, on_piece: Callable[[str], object] | None = None, **kwargs) -> EngineOutput:
        """The whole output after ``prompt`` (anything :meth:`steps` takes, with its keywords), and
        each text piece given to ``on_piece`` as it is accepted (a terminal's stream)."""
        stats, pieces, ids = DecodeStats(), [], []

        def take(step: tuple[str, list[int]]) -> None:
            pieces.append(step[0])
            ids.extend(step[1])
            if on_piece is not None:
                on_piece(step[0])

        reason = consume(self.steps(prompt, stats, stream_text=on_piece is not None, **kwargs), take)
        return EngineOutput("".join(pieces), ids, stats, reason)

    def _pieces(self, input_ids: torch.Tensor, kwargs: dict) -> Iterator[str]:
        return (piece for piece, _ in self.steps(input_ids, DecodeStats(), **kwargs))

    def constraint(self, constraint):
        """A request's constraint compiled for this engine's tokenizer (a spec of
        :mod:`hasten.structured`; a compiled one is checked against the vocabulary; None stays None)."""
        constraint = compiled(constraint, self.tokenizer, self.runtime.vocab_size)
        if constraint is not None:
            start_mask(constraint)  # its first mask now, on the caller's thread (the server's: not the event loop)
        return constraint

    def request(self, input_ids: torch.Tensor | list[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
                top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                stop: str | list[str] | None = None, speculate: bool = True, pool: bool = True,
                model_inputs: dict | None = None, constraint=None, **rules) -> Request:
        """The one request object of a generation from this engine's keywords (those of
        :meth:`steps`); ``speculate=False`` decodes plainly, ``pool=False`` keeps the generation out
        of its drafter's shared pool (:attr:`pool`). Checked when it is admitted."""
        if isinstance(input_ids, torch.Tensor):
            if input_ids.ndim != 2 or input_ids.shape[0] != 1:
                raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
            input_ids = input_ids[0].tolist()
        # the generation config's EOS ids, as in Hugging Face generate (filled in at admission)
        return request_from(input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=stop, tokenizer=self.tokenizer, speculate=speculate, pool=pool,
                            model_inputs=model_inputs, constraint=self.constraint(constraint), **rules)

    def steps(
        self,
        prompt: str | torch.Tensor,
        stats: DecodeStats,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        images: list | None = None,
        constraint=None,
        stream_text: bool = True,
        **rules,
    ) -> Generator[tuple[str, list[int]], None, str | None]:
        """Yield (text piece, token ids) per decode step; ``stats`` fills in as it runs.
        ``prompt`` is text (see :meth:`encode`), input ids [1, T] (e.g. :meth:`encode_chat`'s),
        or input ids with a vision-language model's image inputs (as :meth:`encode_images` and
        :meth:`encode_chat_images` return them).
        ``stop``: stop strings; generation ends at the token that completes one, and the
        text ends before it (as OpenAI's ``stop``). ``images``: with a text prompt, for a
        vision-language model (see :meth:`encode_images`). ``rules``: the other fields of
        :class:`~hasten.core.sampling.Sampling` (``min_p``, ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, ``allowed_token_ids``,
        ``min_tokens``), which transform the target distribution as vLLM's. ``constraint``: the
        text follows it (structured output): ``hasten.JsonSchema(schema)`` (``JsonSchema()``: any
        JSON object), ``hasten.Regex(pattern)``, ``hasten.Choice([...])`` or ``hasten.Grammar(text)``
        (Lark or GBNF); greedy text is plain constrained decoding's, token for token, with any
        method (see :mod:`hasten.engine.constraint`). ``stream_text=False``: the text pieces are
        empty until the last item, which holds the whole text (decoded once, not at every step).
        Returns (as a generator returns) why it ended: "stop" (EOS or a stop string) or "length"."""
        model_inputs: dict = {}
        if images is not None:
            if not isinstance(prompt, str):
                raise TypeError("images go with a text prompt; a chat takes its images in encode_chat_images "
                                "(or chat(messages, images=...))")
            input_ids, model_inputs = self.encode_images(prompt, images)
        elif isinstance(prompt, tuple):  # ids and image inputs, encoded already
            input_ids, model_inputs = prompt
        else:
            input_ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        request = self.request(input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                               top_p=top_p, seed=seed, stop=stop, model_inputs=model_inputs,
                               constraint=constraint, **rules)
        text = TextStream(self.tokenizer, request.stop, streaming=stream_text)
        decoding = stepped_in_threads(decode(self.runtime, request, self.drafter, stats,
                                             acceptance_rule(request.sampling), self.planner), self.threads)
        reason = yield from mapped(decoding, lambda step: (text.push(step), step))
        tail = text.finish()
        if tail:
            yield tail, []
        return reason


def _has_image_entries(messages) -> bool:
    """Whether a chat's messages hold an image entry in a content list."""
    return isinstance(messages, (list, tuple)) and any(
        isinstance(message, dict) and isinstance(message.get("content"), list)
        and any(isinstance(entry, dict) and entry.get("type") == "image" for entry in message["content"])
        for message in messages)


def load(
    name_or_path: str | os.PathLike | PreTrainedModel,
    method: str = DEFAULT_METHOD,
    *,
    draft: str | os.PathLike | PreTrainedModel | None = None,
    tokenizer=None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    draft_size: str | SizingRule | None = None,
    processor=None,
    backend: str = "torch",
    threads: int | None = DEFAULT_THREADS,
    **method_kwargs,
) -> Engine:
    """Load a model with an acceleration method.

    ``name_or_path``: a zoo name, a ``.gguf`` file or a directory holding one, a local
    Hugging Face directory, a hub id, or a model already in memory (a ``PreTrainedModel``;
    then pass its ``tokenizer=`` too). ``tokenizer`` (an object or a path) replaces the
    model's own. ``device`` defaults to the CPU. ``dtype`` defaults, for a model loaded here,
    to the one rule ``hasten generate`` and ``hasten serve`` follow too (``--dtype auto``,
    :func:`hasten.arguments.resolve_dtype`): bfloat16 on a CPU with native bfloat16
    instructions (AMX or AVX512-BF16, as vLLM's CPU build picks), else float32; so the same
    request gives the same text through the library and the command line. Speculative output
    equals hasten's plain decoding in either dtype; pass ``dtype="float32"`` for Hugging Face
    ``generate``'s exact tokens. A model passed in keeps its own dtype unless ``dtype`` is
    given (a draft passed in takes the target's). ``dtype="int8"`` runs the
    model (and a draft loaded here) with int8 linear layers on the CPU (docs/cpu.md).
    ``method`` is ``"autoregressive"``, a registered drafter name or ``"default"``: ``mixed``
    (copying and EAGLE-3's guesses in one tree) for a model whose trained EAGLE-3 weights are
    found beside it or shipped in the zoo (:func:`default_method`), else ``prompt_lookup``; on the
    llama.cpp backend ``prompt_lookup``. ``engine.method`` names what was chosen. ``method_kwargs``
    are a named method's settings, e.g. ``load(path, "prompt_lookup", num_tokens=8)``.
    ``draft_size``: ``"fixed"`` (each drafter's own depth) or ``"auto"`` (each step's depth
    chosen from this machine's measured forward cost and the drafter's measured acceptance;
    the cost is calibrated here, once per model and machine, and cached). Unset (None): auto,
    but fixed for sampling with a seed, so that a seed gives the same text every run.
    ``processor`` (an object or a path): a vision-language model's, which turns text and
    images into its inputs; loaded from the model's directory when not given.
    ``backend="llama.cpp"`` runs a GGUF target (and a GGUF draft) in llama.cpp instead of
    PyTorch: hasten's drafters propose, llama.cpp verifies (docs/cpu.md).
    ``threads``: CPU threads torch computes with while the engine loads and generates (torch's
    count is the process's: the caller's is back between steps), 1 by default as on the command
    line (on a busy machine torch's default of one per core was 4-10x slower; see
    :mod:`hasten.core.threads`); 0 takes every core, None leaves torch's setting alone. With
    llama.cpp, its threads.
    """
    check_method(method, draft is not None, bool(method_kwargs))  # before the seconds spent loading models
    SizingChoice(draft_size)  # a bad draft_size fails before the seconds spent loading models
    if backend not in ("torch", "llama.cpp"):
        raise ValueError(f"backend must be 'torch' or 'llama.cpp', got {backend!r}")
    if dtype is None and backend == "torch" and not isinstance(name_or_path, PreTrainedModel):
        dtype = resolve_dtype(AUTO_DTYPE, str(device or "cpu"))[0]  # the command line's rule, written once
    with using_threads(threads):  # what loading computes (a calibration, a warm-up) runs as generations will
        if backend == "llama.cpp":
            engine = _load_llama_cpp(name_or_path, method, draft, tokenizer, dtype, device, draft_size, threads,
                                     method_kwargs)
        else:
            engine = _load_torch(name_or_path, method, draft, tokenizer, dtype, device, draft_size, processor,
                                 threads, method_kwargs)
        engine.runtime.warm_up()
    return engine


def _load_torch(name_or_path, method, draft, tokenizer, dtype, device, draft_size, processor, threads,
                method_kwargs) -> Engine:
    model = as_model(name_or_path, dtype, device)
    if tokenizer is None and isinstance(name_or_path, PreTrainedModel):
        raise ValueError("a model passed as an object needs its tokenizer: load(model, tokenizer=...)")
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(name_or_path if tokenizer is None else tokenizer)
    draft_model = draft
    if isinstance(draft, (str, os.PathLike)):
        draft_model = as_model(draft, dtype, device)
        draft_tokenizer = optional_tokenizer(draft)
        if draft_tokenizer is not None and vocab_size(draft_model) == vocab_size(model):
            warn_if_tokenizers_differ(tokenizer, draft_tokenizer, str(draft))
    elif draft is not None:
        draft_model = as_model(draft, torch.float32 if dtype == INT8 else dtype, device)  # an object: not quantized
    if method == DEFAULT_METHOD:
        method = default_method(model)
    drafter = make_drafter(method, draft_model, **method_kwargs)
    if draft_size in ("auto", None) and drafter is not None:
        load_or_calibrate(model)  # now, at load, rather than inside the first generation
    if vlm.is_vision_language(model) and (processor is None or isinstance(processor, (str, os.PathLike))):
        processor = load_processor(name_or_path if processor is None else processor)
    return Engine(model, tokenizer, drafter, method, draft_size, processor, threads, _given_name(name_or_path))


def _load_llama_cpp(name_or_path, method, draft, tokenizer, dtype, device, draft_size, threads,
                    method_kwargs) -> Engine:
    """The llama.cpp backend: a GGUF target (and draft) loaded by llama.cpp; the tokenizer is
    read from the same file, its weights left alone."""
    from .models.llamacpp import LlamaCppModel, note_flash_attention

    if dtype is not None or (device is not None and str(device) != "cpu"):
        raise ValueError("the llama.cpp backend runs the GGUF file's own quantisation on the CPU: "
                         "leave dtype and device unset")
    threads = torch.get_num_threads()

    def open_gguf(name) -> LlamaCppModel:
        return LlamaCppModel(gguf_source(name), threads=threads)

    if not isinstance(name_or_path, (str, os.PathLike)) or (draft is not None and not isinstance(draft, (str, os.PathLike))):
        raise TypeError("the llama.cpp backend loads models from .gguf paths or zoo names")
    model = open_gguf(name_or_path)
    note_flash_attention()  # what its greedy text equals: llama.cpp with flash_attn=True
    if tokenizer is None:
        tokenizer = gguf_tokenizer(name_or_path)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(tokenizer)
    if method == DEFAULT_METHOD:
        method = COPIED  # the trained drafters read PyTorch features llama.cpp does not hand out
    drafter = make_drafter(method, None if draft is None else open_gguf(draft), **method_kwargs)
    if drafter is not None:
        drafter.check_runtime(model)  # now, not at the first generation
        if draft_size in ("auto", None):
            load_or_calibrate(model)  # llama.cpp's own cost curve, now rather than inside the first generation
    return Engine(model, tokenizer, drafter, method, draft_size, threads=threads, name=_given_name(name_or_path))


def _given_name(name_or_path) -> str | None:
    """The name a model was loaded by (None for a model passed as an object)."""
    return os.fspath(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else None


