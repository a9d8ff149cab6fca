"""Loading what hasten runs: a model, tokenizer or processor from a zoo name, a ``.gguf`` file,
a local Hugging Face directory or a hub id (which fails at once when the hub cannot serve it).
:func:`hasten.load` (in :mod:`hasten.api`) builds an Engine from these."""
from __future__ import annotations

import contextlib
import os
import re
import socket
import urllib.parse
import warnings

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM, AutoProcessor, AutoTokenizer,
    PreTrainedModel,
)

from . import zoo
from .core.errors import HastenWarning
from .models import gguf
from .models.quantize import quantize
from .zoo.packing import unpacked


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "gpt2" or "org/name"; never a filesystem path


def resolve_path(name_or_path: str | os.PathLike) -> str:
    """The local directory (or hub id) holding a model's Hugging Face files.

    Takes a zoo name ("zoo:code-tiny", "zoo:smollm2-135m"), a ``.gguf`` file or a directory
    holding one (dequantised into the cache on first use), a local Hugging Face directory,
    or a hub id; a hub id that is neither cached nor reachable fails here, at once.
    """
    path = os.fspath(name_or_path)
    if zoo.is_zoo_name(path):
        path = str(zoo.resolve(path, cache_dir=gguf.cache_root()))
    if os.path.isdir(path):
        path = str(unpacked(path))  # a packed directory (the zoo's shipped form): its unpacked copy
    if os.path.exists(path):
        source = gguf.find_gguf(path)
        return str(gguf.cached_checkpoint(source)) if source is not None else path
    check_hub_id(path)
    return path


def check_hub_id(name: str) -> None:
    """Raise ValueError for a name that is no local path unless the hub can serve it: from its
    local cache or, failing that, over a network that answers (a quick connect, instead of
    the hub client's ~27 s of retries before it reports the path missing)."""
    if name.endswith(gguf.SUFFIX) or not HUB_ID.fullmatch(name) or name.startswith("."):
        raise ValueError(f"model {name!r} could not be loaded: no such file or directory")
    import huggingface_hub
    from huggingface_hub import constants

    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json"), str):
        return
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    why = "HF_HUB_OFFLINE is set" if offline else hub_unreachable(constants.ENDPOINT)
    if why:
        raise ValueError(
            f"model {name!r} could not be loaded: it is not a local path, and the Hugging Face hub is "
            f"unreachable ({why}); pass a "
            "local directory, a .gguf file or a zoo name (zoo:code-tiny, or zoo:smollm2-135m after `make real`)")


def hub_unreachable(endpoint: str, timeout_s: float = 3.0) -> str | None:
    """Why ``endpoint`` cannot be reached (None when a TCP connection opens)."""
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        return f"{url.hostname}: {err.strerror or err}"
    return None


INT8 = "int8"  # int8 linear layers over float32 weights (hasten.models.quantize), CPU only


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """torch.float32 or its name ("float32", "bfloat16", "float16"); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype), None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is no floating-point torch dtype (try float32, bfloat16, float16)")
    return found


def load_model(name_or_path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
               device: str = "cpu") -> PreTrainedModel:
    """The model a name or path holds, in ``dtype`` (a torch dtype, its name, or "int8": int8
    linear layers on the CPU, docs/cpu.md) on ``device``."""
    int8 = dtype == INT8
    dtype = torch.float32 if int8 else as_dtype(dtype)
    path = resolve_path(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path)
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        if getattr(config, "vision_config", None) is not None:  # a vision-language model: its vision tower too
            auto = AutoModelForImageTextToText
        with quiet_progress():
            model = auto.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        where = "no such directory" if not os.path.exists(path) else str(err).splitlines()[0]
        raise ValueError(f"model {name_or_path!r} could not be loaded: {where}") from err
    model = model.to(device).eval()
    return quantize(model, INT8) if int8 else model

@contextlib.contextmanager
def quiet_progress():
    """transformers' progress bars off inside the block, as they were after it: its "Loading
    weights" bar on every load of a small model tells a user nothing (a first GGUF conversion,
    which takes a minute, keeps its bars)."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def warn_if_tokenizers_differ(tokenizer, draft_tokenizer, draft_name: str, samples: int = 1000) -> None:
    """A draft model with the target's vocabulary size but another tokenizer is accepted
    (outputs stay exact) yet its drafts mean other text, so they are rarely accepted: warn.
    Compares the token strings of ``samples`` ids spread over the shared id range."""
    shared = min(len(tokenizer), len(draft_tokenizer))
    ids = sorted({round(i * (shared - 1) / max(samples - 1, 1)) for i in range(samples)}) if shared else []
    ours, theirs = tokenizer.convert_ids_to_tokens(ids), draft_tokenizer.convert_ids_to_tokens(ids)
    differ = [(i, a, b) for i, a, b in zip(ids, ours, theirs) if a != b]
    if differ:
        token, a, b = differ[0]
        warnings.warn(
            f"draft model {draft_name!r} has another tokenizer than the target ({len(differ)} of {len(ids)} "
            f"sampled ids differ, e.g. id {token} is {b!r} there and {a!r} in the target's): outputs stay "
            "exact but few drafts will be accepted", HastenWarning, stacklevel=3,
        )

def gguf_source(name: str | os.PathLike) -> "os.PathLike":
    """The .gguf file a zoo name, a file or a directory names (for the llama.cpp backend);
    ValueError otherwise."""
    path = os.fspath(name)
    source = gguf.find_gguf(str(zoo.resolve(path, cache_dir=gguf.cache_root())) if zoo.is_zoo_name(path) else path)
    if source is None:
        raise ValueError(f"the llama.cpp backend needs a .gguf file (or a zoo name of one); {name!r} is none")
    return source


def gguf_tokenizer(name: str | os.PathLike):
    """The tokenizer written in a GGUF file (transformers rebuilds it from the file's
    vocabulary), without dequantising the weights as a PyTorch load does."""
    source = gguf_source(name)
    return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)


def as_model(model_or_path, dtype: torch.dtype | str | None, device) -> PreTrainedModel:
    """Load a model from a path or name (see :func:`load_model`); a model object is moved, cast or
    quantized only where asked."""
    if isinstance(model_or_path, (str, os.PathLike)):
        return load_model(model_or_path, dtype or torch.float32, device or "cpu")
    if not isinstance(model_or_path, PreTrainedModel):
        raise TypeError(f"expected a model name, path or PreTrainedModel, got {type(model_or_path).__name__}")
    int8 = dtype == INT8
    if dtype is not None or device is not None:
        model_or_path = model_or_path.to(device=device, dtype=torch.float32 if int8 else as_dtype(dtype))
    return quantize(model_or_path.eval(), INT8) if int8 else model_or_path.eval()


def load_tokenizer(name_or_path: str | os.PathLike):
    path = resolve_path(name_or_path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"model {name_or_path!r} has no usable tokenizer: {str(err).splitlines()[0]}") from err


def load_processor(name_or_path) -> object | None:
    """A vision-language model's processor, or None for a model passed as an object
    (Engine.encode_images then asks for processor=)."""
    if isinstance(name_or_path, PreTrainedModel):
        return None
    path = resolve_path(name_or_path)
    try:
        return AutoProcessor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"model {name_or_path!r} has no usable processor: {str(err).splitlines()[0]}") from err


def optional_tokenizer(name_or_path: str):
    """The draft's tokenizer if it ships one (a draft model needs none: it shares the target's)."""
    try:
        return load_tokenizer(name_or_path)
    except ValueError:
        return None
