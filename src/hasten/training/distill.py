"""Self-distillation data: what the target itself says after prompts cut from some text.

Heads and drafters are trained to guess the *target's* next tokens, not the corpus's, so
the labels are the target's own greedy continuations (generated with hasten and prompt
lookup, which is lossless and several times faster than plain decoding here). Prompts are
windows of ``prompt_tokens`` tokens cut at random places from the documents (tokenised
without special tokens); only the generated tokens count as labels. With ``chat`` each
window becomes a user message asking for one of a few tasks on it (summarise, explain,
rewrite, continue, ...) under the tokenizer's chat template, so a drafter for a chat model
learns from the answers it will be measured on (prompts then differ in length).

The result is cached in one safetensors file: token ids and, by default, the target's
last-layer hidden states (one forward per sequence, float16 to halve the file), so that
training never runs the target. An interrupted run resumes where it stopped.
"""
from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file
from tqdm import tqdm
from transformers import PreTrainedModel

from ..core.settings import Settings, option
from ..drafters.prompt_lookup import PromptLookup
from ..drafters.trainable import Batch
from ..engine.loop import generate

CACHE = "distill.safetensors"
SAVE_EVERY_S = 60.0  # an interrupted distillation loses at most this much work
EVAL_FRACTION = 20  # one sequence in this many is held out for evaluation


@dataclass(frozen=True)
class DistillSettings(Settings):
    samples: int = option(256, "prompts to continue, i.e. distilled sequences")
    prompt_tokens: int = option(64, "tokens per prompt, cut at random places from the text")
    gen_tokens: int = option(128, "greedy tokens the target generates after each prompt (fewer if it stops)")
    seed: int = option(0, "seeds the prompt choice, the initialisation and the batch order")
    store_hidden: bool = option(True, "cache the target's hidden states (else recomputed for every batch)")
    chat: bool = option(False, "wrap each prompt window in a user message with an instruction (summarise, "
                               "explain, rewrite, ...) under the tokenizer's chat template; generation stops at EOS")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("samples", "prompt_tokens", "gen_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Distilled:
    ids: torch.Tensor  # [N, L] long, zero-padded after each row's length; L = prompt + gen tokens
    lengths: torch.Tensor  # [N] tokens in each row
    prompt_lengths: torch.Tensor  # [N] leading prompt tokens (not the target's, so not labels)
    hidden: torch.Tensor | None  # [N, L, H] float16 last-layer hidden states, or None

    def __len__(self) -> int:
        return len(self.ids)

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Row indices for training and for held-out evaluation: the last rows, one in
        EVAL_FRACTION (at least one when there are two rows or more; prompts are drawn at
        random, so the last rows are as good a sample as any)."""
        held_out = len(self) // EVAL_FRACTION or min(1, len(self) - 1)
        rows = torch.arange(len(self))
        return rows[: len(self) - held_out], rows[len(self) - held_out :]

    def batch(self, rows: torch.Tensor, target: PreTrainedModel, device: str = "cpu") -> Batch:
        length = int(self.lengths[rows].max())
        ids = self.ids[rows, :length]  # [B, T]
        position = torch.arange(length)[None]  # [1, T]
        label_mask = (position >= self.prompt_lengths[rows, None]) & (position < self.lengths[rows, None])
        if self.hidden is not None:
            hidden = self.hidden[rows, :length].float()  # [B, T, H]
        else:  # right padding cannot change earlier positions of a causal model
            with torch.no_grad():
                hidden = target(ids.to(target.device), output_hidden_states=True).hidden_states[-1].float()
        return Batch(ids.to(device), hidden.to(device), label_mask.to(device))


# ---- text sources ------------------------------------------------------------------------------
def read_documents(path: str | Path) -> list[str]:
    """A .txt file is one document; a .jsonl file holds one per line, as a JSON string or
    an object with a "text" field."""
    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise ValueError(f"--data {path}: expected a .txt or .jsonl file")
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise ValueError(f"--data {path}: {err.strerror}") from None
    if path.suffix == ".txt":
        return [text]
    documents = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"--data {path}:{number}: not JSON ({err.msg})") from None
        if isinstance(record, dict):
            record = record.get("text")
        if not isinstance(record, str):
            raise ValueError(f'--data {path}:{number}: expected a string or an object with a "text" string')
        documents.append(record)
    return documents


def zoo_documents() -> list[str]:
    """The zoo's training corpus (the Python stdlib sources, held-out files excluded)."""
    from ..zoo import corpus

    return [corpus.read_text(p) for p in corpus.training_files()]


def pick_prompts(documents: list[str], tokenizer, settings: DistillSettings) -> list[list[int]]:
    """``samples`` windows of ``prompt_tokens`` tokens; documents drawn in proportion to
    their length, so every part of the text is equally likely to be cut."""
    rng = random.Random(settings.seed)
    weights = [len(d) for d in documents]
    if not any(weights):
        raise ValueError("the training text is empty")
    tokenised: dict[int, list[int]] = {}
    prompts = []
    for _ in range(100 * settings.samples):
        if len(prompts) == settings.samples:
            return prompts
        doc = rng.choices(range(len(documents)), weights)[0]
        if doc not in tokenised:
            tokenised[doc] = tokenizer(documents[doc], add_special_tokens=False).input_ids
        ids = tokenised[doc]
        if len(ids) >= settings.prompt_tokens:
            start = rng.randrange(len(ids) - settings.prompt_tokens + 1)
            window = ids[start : start + settings.prompt_tokens]
            prompts.append(chat_prompt(window, tokenizer, rng) if settings.chat else window)
    raise ValueError(f"the training text has too few documents of at least {settings.prompt_tokens} tokens")


# What a user might ask about a piece of text; one is drawn per prompt. Kept apart from the
# benchmark's prompts (hasten.bench.chat_tasks), which are never used for training.
INSTRUCTIONS = (
    "Summarise the following text in a few sentences.",
    "Explain the following text in simple words.",
    "Rewrite the following text so that it is clearer and easier to read.",
    "Continue the following text.",
    "List the main points of the following text as a numbered list.",
    "Correct any spelling or grammar mistakes in the following text and return it.",
    "Write three questions a reader might ask about the following text, and answer them.",
    "Translate the following text into French.",
)


def chat_prompt(window: list[int], tokenizer, rng: random.Random) -> list[int]:
    """``window`` as the text of one user message that asks for a task on it, with the
    tokenizer's chat template and the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("--chat needs a tokenizer with a chat template (this target's has none)")
    text = tokenizer.decode(window, skip_special_tokens=True).strip()
    message = {"role": "user", "content": f"{rng.choice(INSTRUCTIONS)}\n\n{text}"}
    return list(tokenizer.apply_chat_template([message], add_generation_prompt=True, return_dict=True)["input_ids"])


def pydoc_documents() -> list[str]:
    """Python's own reference text (``pydoc_data.topics``, shipped with the standard
    library): English prose about a programming language, one document per topic."""
    from pydoc_data.topics import topics

    return [text for _, text in sorted(topics.items())]


# ---- distillation --------------------------------------------------------------------------------
@torch.no_grad()
def distill(model: PreTrainedModel, tokenizer, documents: list[str], settings: DistillSettings,
            work_dir: Path, *, source: str, resume: bool = False, progress: bool = True) -> Distilled:
    """Generate (or, with ``resume``, reuse and complete) the distilled data in
    ``work_dir``. ``source`` names the text, so a cache of other data is never reused."""
    if model.config.is_encoder_decoder:
        raise ValueError("hasten train supports causal LMs only")
    key = json.dumps({"model": model.config._name_or_path, "source": source, **asdict(settings)}, sort_keys=True)
    path = Path(work_dir) / CACHE
    rows = _load_rows(path, key) if resume else []
    if len(rows) == settings.samples:
        return _stack(rows, settings)
    prompts = pick_prompts(documents, tokenizer, settings)
    # chat answers end at the end-of-turn token, as they will when measured; plain text runs on
    eos = model.generation_config.eos_token_id if settings.chat else None
    drafter = PromptLookup()
    saved_at = time.monotonic()
    for prompt in tqdm(prompts[len(rows):], desc="distill", initial=len(rows), total=settings.samples,
                       disable=not progress, file=sys.stderr, mininterval=2):
        prompt_ids = torch.tensor([prompt], device=model.device)  # [1, P]
        sequence = generate(model, prompt_ids, drafter=drafter, max_new_tokens=settings.gen_tokens,
                            eos_token_id=eos, threads=None).sequences  # [1, L]; threads: the command's
        hidden = None
        if settings.store_hidden:
            hidden = model(sequence.to(model.device), output_hidden_states=True).hidden_states[-1][0].half().cpu()  # [L, H]
        rows.append((sequence[0].cpu(), hidden, len(prompt)))
        if time.monotonic() - saved_at > SAVE_EVERY_S:
            _save(path, key, _stack(rows, settings))
            saved_at = time.monotonic()
    data = _stack(rows, settings)
    _save(path, key, data)
    return data


def _stack(rows: list[tuple[torch.Tensor, torch.Tensor | None, int]], settings: DistillSettings) -> Distilled:
    """Rows of (sequence [L], hidden [L, H] or None, prompt length) padded into one batch."""
    width = max((len(sequence) for sequence, _, _ in rows), default=settings.prompt_tokens + settings.gen_tokens)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    hidden = None
    if settings.store_hidden and rows:
        hidden = torch.zeros(len(rows), width, rows[0][1].shape[-1], dtype=torch.float16)
    for i, (sequence, states, _) in enumerate(rows):
        ids[i, : len(sequence)] = sequence
        if hidden is not None:
            hidden[i, : len(states)] = states
    lengths = torch.tensor([len(sequence) for sequence, _, _ in rows], dtype=torch.long)
    prompt_lengths = torch.tensor([prompt for _, _, prompt in rows], dtype=torch.long)
    return Distilled(ids, lengths, prompt_lengths, hidden)


def _save(path: Path, key: str, data: Distilled) -> None:
    tensors = {"ids": data.ids, "lengths": data.lengths, "prompt_lengths": data.prompt_lengths}
    if data.hidden is not None:
        tensors["hidden"] = data.hidden
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    save_file(tensors, temporary, metadata={"key": key})
    temporary.replace(path)


def _load_rows(path: Path, key: str) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
    """The rows of a cache made with the same key, or none."""
    if not path.is_file():
        return []
    with safe_open(path, "pt") as f:
        if f.metadata().get("key") != key:
            tqdm.write(f"distill: {path} holds other data; starting over", file=sys.stderr)
            return []
    tensors = load_file(path)
    hidden, prompt_lengths = tensors.get("hidden"), tensors["prompt_lengths"].tolist()
    return [
        (tensors["ids"][i, :n], None if hidden is None else hidden[i, :n], prompt_lengths[i])
        for i, n in enumerate(tensors["lengths"].tolist())
    ]
