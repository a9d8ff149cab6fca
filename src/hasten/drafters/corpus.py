"""A corpus for the pooled drafters (``lookahead``, ``suffix``): a text file, tokenized with the
target's own tokenizer, that a pool learns as if it were generated text."""
from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4)
def corpus_ids(path: str, model_dir: str) -> tuple[int, ...]:
    """The token ids of the text file at ``path`` (ValueError naming what is missing)."""
    from transformers import AutoTokenizer  # only when a corpus is given: drafters import no model code

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ValueError(f"corpus {path!r}: {err.strerror}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise ValueError(f"a corpus needs the target's tokenizer, none found at {model_dir!r}") from err
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)
