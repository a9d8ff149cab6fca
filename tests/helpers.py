"""Tiny randomly initialised models of several architectures, and scripted drafters.

``HASTEN_TEST_DEVICE`` (default cpu) puts the tiny models and prompts on another device:
scripts/gpu-check runs the greedy-equality and sampling-law suites with it set to cuda."""
from __future__ import annotations

import math
import os

import torch
import transformers as tf

from hasten.drafters.base import Draft, DraftContext, Drafter

VOCAB = 96
DEVICE = torch.device(os.environ.get("HASTEN_TEST_DEVICE", "cpu"))

_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CAUSAL_CONFIGS = {
    "llama": lambda: tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **_COMMON),
    "qwen2": lambda: tf.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **_COMMON),
    "mistral": lambda: tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=16, **_COMMON),
    "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=512, **_COMMON),
    "gpt_neox": lambda: tf.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512, **_COMMON),
    "phi3": lambda: tf.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, **_COMMON),
}

SEQ2SEQ_CONFIGS = {
    "t5": lambda: tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=0, **_COMMON),
    "bart": lambda: tf.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=512, decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None, **_COMMON),
}


def tiny_model(arch: str, seed: int = 0, **overrides) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    if arch in CAUSAL_CONFIGS:
        config = CAUSAL_CONFIGS[arch]()
        auto = tf.AutoModelForCausalLM
    else:
        config = SEQ2SEQ_CONFIGS[arch]()
        auto = tf.AutoModelForSeq2SeqLM
    for key, value in overrides.items():
        setattr(config, key, value)
    model = auto.from_config(config)
    return model.to(DEVICE).eval()


def repetitive_prompt(length: int = 24, seed: int = 0) -> torch.Tensor:
    """A prompt that repeats itself, so that input-guided drafters find matches."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(3, VOCAB, (length // 2,), generator=g)
    return torch.cat([half, half])[None].to(DEVICE)  # [1, length]


def hf_greedy(model, input_ids, max_new_tokens, **kwargs) -> torch.Tensor:
    return model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)


def assert_tree_matches_branches(model, prompt: list[int], tokens, tree) -> None:
    """Tree attention over ``[root] + tokens`` gives, on every root-to-leaf path, the logits
    of running that branch alone after the prompt."""
    from hasten.models.adapter import ModelAdapter

    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prompt]))
    logits = adapter.forward([prompt[-1], *tokens], tree).logits  # [1 + nodes, vocab]
    for path in tree.leaf_paths:
        plain = model(torch.tensor([prompt + [tokens[n] for n in path]])).logits[0]  # [T + depth, vocab]
        block = [0] + [n + 1 for n in path]
        torch.testing.assert_close(logits[block], plain[len(prompt) - 1 :], rtol=1e-4, atol=1e-4)


def assert_scripted_stats(stats, mode, draft_len: int) -> None:
    """What a scripted drafter's mode implies: an oracle commits draft + bonus every step,
    an adversary gets nothing accepted, an error at j accepts at most j tokens a step."""
    if mode == "oracle":
        assert stats.steps == -(-stats.new_tokens // (draft_len + 1))
    elif mode == "adversarial":
        assert stats.accepted_tokens == 0
    else:
        assert 0 < stats.mean_accepted <= mode + 1


def generate_exactly(model, prompt, reference, drafter, max_new_tokens, draft_size="fixed"):
    """Greedy generation with ``drafter`` must reproduce ``reference`` token for token; returns its
    stats. Fixed sizing by default: the callers count steps against the drafter's own depth."""
    import hasten

    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=max_new_tokens, draft_size=draft_size)
    assert out.sequences.tolist() == reference.tolist()
    return out.stats


class ScriptedDrafter(Drafter):
    """Proposes the reference continuation, optionally with a planted error.

    mode: "oracle" (always right), "adversarial" (always wrong) or an int j (the draft
    token at position j is wrong, the ones before it right). Checks the cache invariant
    at every step: the target caches every committed token but the root.
    """

    name = "scripted"

    def __init__(self, reference: list[int], num_tokens: int, mode="oracle"):
        self.reference, self.num_tokens, self.mode = reference, num_tokens, mode
        self.calls = 0

    def propose(self, ctx: DraftContext) -> Draft:
        assert ctx.target.cache_length == len(ctx.tokens) - 1, "cache must hold all committed tokens but the root"
        assert ctx.tokens == self.reference[: len(ctx.tokens)], "committed tokens left the reference"
        self.calls += 1
        start = len(ctx.tokens)
        right = self.reference[start : start + min(self.num_tokens, ctx.max_depth)]
        vocab = ctx.target.vocab_size
        wrong = lambda t: (t + 1) % vocab  # noqa: E731
        if self.mode == "oracle":
            tokens = right
        elif self.mode == "adversarial":
            tokens = [wrong(t) for t in right]
        else:
            tokens = [wrong(t) if i == self.mode else t for i, t in enumerate(right)]
        return Draft.chain(tokens)


def tiny_tokenizer():
    """A byte-level BPE tokenizer of VOCAB tokens trained on a few lines of code."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())[:60]
    )
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def json_tokenizer():
    """A byte-level BPE tokenizer of a JSON alphabet (braces, quotes, digits, lower-case letters),
    trained on a few JSON lines: what the structured-output tests write with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_char = _byte_chars()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = [byte_char[b] for b in b'{}[]":,.-_ 0123456789abcdefghijklmnopqrstuvwxyz\n']
    text = ['{"name": "ada", "age": 36, "tags": ["math", "code"]}', '{"name": "alan", "age": 41, "ok": true}',
            '{"city": "paris", "people": 2100000}', "yes", "no", "maybe"] * 20
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=alphabet)
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the character that stands for it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def save_checkpoint(path, arch="llama", seed=0) -> str:
    tiny_model(arch, seed=seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


class TreeScriptedDrafter(ScriptedDrafter):
    """A tree of ``width`` siblings per level along the reference path, ``depth`` deep.

    The right token sits at sibling index ``right_sibling`` at every level; from depth
    ``error_at`` on (0-based; None: never) it is replaced by a wrong one, so the accepted
    path ends there. Wrong siblings are distinct from each other and from the right token.
    """

    def __init__(self, reference, depth=4, width=3, right_sibling=0, error_at=None):
        super().__init__(reference, depth)
        self.width, self.right_sibling, self.error_at = width, right_sibling, error_at

    def propose(self, ctx: DraftContext) -> Draft:
        from hasten.core.tree import TokenTree

        right = super().propose(ctx).tokens  # checks the invariants, yields the reference
        vocab = ctx.target.vocab_size
        tokens, parents, parent = [], [], -1
        for level, token in enumerate(right):
            truth = token if self.error_at is None or level < self.error_at else None
            wrong = [(token + 1 + w) % vocab for w in range(self.width)]
            siblings = wrong[: self.width - 1]
            siblings.insert(self.right_sibling, truth if truth is not None else wrong[-1])
            first = len(tokens)
            tokens.extend(siblings)
            parents.extend([parent] * len(siblings))
            parent = first + self.right_sibling  # descend along the (possibly wrong) branch
        return Draft(tuple(tokens), TokenTree(tuple(parents)))


# ---- trained drafters in tests: a few steps on a model's own continuations ----------------------
TRAIN_TEXT = ["def add(a, b):\n    return a + b\n" * 4, "for i in range(10):\n    print(i)\n" * 4]


def distill_tiny(model, work_dir):
    """Six short self-distilled sequences: enough data to train a drafter for a few steps."""
    from hasten.training.distill import DistillSettings, distill

    settings = DistillSettings(samples=6, prompt_tokens=8, gen_tokens=12)
    return distill(model, tiny_tokenizer(), TRAIN_TEXT, settings, work_dir, source="test", progress=False)


def train_briefly(trainable, data, out_dir, steps):
    """Train ``trainable`` for ``steps`` steps and save it where its drafter loads it from."""
    from hasten.training.trainer import TrainSettings, train

    result = train(trainable, data, TrainSettings(steps=steps, lr=3e-2, warmup_steps=1, batch_size=4),
                   out_dir / "work", progress=False)
    trainable.save(result.module, out_dir, {"target": "test", **result.report})
    return out_dir


def ours(record) -> list:
    """The warnings hasten raised among those pytest recorded (a dependency's deprecation
    notices are not ours to count)."""
    from hasten.core.errors import HastenWarning

    return [w for w in record if issubclass(w.category, HastenWarning)]


def returned_cache(output):
    """The cache a forward returned: ``output.cache`` on transformers >= 5.24,
    ``output.past_key_values`` before (the old name still answers there, with a warning)."""
    from hasten.models.compat import NEW_CACHE_KEYWORD, OLD_CACHE_KEYWORD

    return output[NEW_CACHE_KEYWORD] if NEW_CACHE_KEYWORD in output.keys() else output[OLD_CACHE_KEYWORD]


def opinionated(module, seed: int):
    """Random weights large enough that a drafter's guesses depend on everything it reads (and
    its drafts are sometimes right, sometimes not)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.ndim == 2:
                torch.nn.init.normal_(parameter, std=1.0 / math.sqrt(parameter.shape[1]))
    return module


CHAT_EOS = 2  # the tiny tokenizer's end of turn
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def chat_model(eos_bias: float, scale: float = 1.0, **overrides):
    """A tiny random Llama that chats: its LM head's weights times ``scale`` (sharper choices) and
    a bias of ``eos_bias`` on the end-of-turn token (so turns end), and a tokenizer with a chat
    template. Returns (model, tokenizer)."""
    model = tiny_model("llama", seed=1, **overrides)
    head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * scale)
        head.bias.zero_()
        head.bias[CHAT_EOS] = eos_bias
    model.lm_head = head
    model.config.tie_word_embeddings = False
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer
