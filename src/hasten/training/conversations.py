"""Training rows from the conversations a chat model wrote itself (:mod:`hasten.training.selfgen`).

One row per answer: the chat template over the messages before it, with the assistant's turn
opened (exactly what the model reads when it is asked in use), then the answer's own token ids
as the model generated them (its end-of-turn token included). Only the answer's positions are
labels; a follow-up's row holds the first answer again as context, unlabelled there, since
the first row already learns it.

Held-out conversations are chosen by construction: a fixed hash of the record's id (its seed
and index) decides, once and for every run, so a record is held out whatever else the data
holds and however often it is read; both answers of a conversation land on the same side.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator

from .selfgen import training_pairs

HELD_OUT_EVERY = 20  # one conversation in this many is held out (never trained on)


@dataclass(frozen=True)
class ConversationRow:
    record: int  # the record's index in the self-generated data
    greedy: bool  # the answer is the target's greedy continuation (else sampled)
    held_out: bool
    ids: tuple[int, ...]  # prompt then answer
    prompt_length: int  # leading tokens that are not the answer (not labels)


def is_held_out(record: dict) -> bool:
    """Whether a record is held out: a fixed hash of its seed and index, never trained on."""
    digest = hashlib.sha256(f"{record['seed']}:{record['index']}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_EVERY == 0


def conversation_rows(records: Iterable[dict], tokenizer, max_tokens: int) -> Iterator[ConversationRow]:
    """Each record's answers as rows; a row longer than ``max_tokens`` keeps its first
    ``max_tokens`` tokens (an answer cut that way keeps what fits), a prompt that fills them
    gives no row."""
    for record in records:
        held_out, greedy = is_held_out(record), record["mode"] == "greedy"
        for prompt, answer in training_pairs(record, tokenizer):
            if len(prompt) >= max_tokens:
                continue
            ids = (*prompt, *answer)[:max_tokens]
            yield ConversationRow(record["index"], greedy, held_out, ids, len(prompt))
