"""Chat: ``Engine.chat`` / ``chat_stream`` and ``hasten generate --chat``, plus the runtime
flags of ``hasten generate`` (--device, --dtype, --threads).

A tiny random Llama and the test tokenizer, given a chat template that writes its own BOS
while the tokenizer also adds one to plain text (as Llama's do): a chat must get one BOS.
"""
import json
import os

import pytest
import torch
from tokenizers import processors

import hasten
from hasten.api import Engine, make_drafter
from helpers import hf_greedy, save_checkpoint, tiny_model, tiny_tokenizer

BOS = 1
NEW = 16
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SYSTEM = "You repeat code."
USER = "def add(a, b):\n    return a + b\n\ndef add("
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def chat_tokenizer(template: str = TEMPLATE):
    tokenizer = tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    tokenizer.chat_template = template
    return tokenizer


def templated(tokenizer, messages=MESSAGES) -> torch.Tensor:
    """The input ids Hugging Face's own chat recipe gives ([1, T])."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True,
                                            return_tensors="pt")
    return encoded["input_ids"]


def engine_for(model, tokenizer, method="autoregressive") -> Engine:
    return Engine(model, tokenizer, make_drafter(method), method)


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_the_template_writes_the_only_bos(model, tokenizer):
    assert tokenizer("x").input_ids[0] == BOS  # plain text gets the tokenizer's BOS ...
    ids = templated(tokenizer)[0].tolist()
    assert ids[0] == BOS and ids.count(BOS) == 1  # ... a chat only the template's
    assert engine_for(model, tokenizer).encode_chat(MESSAGES).tolist() == [ids]


@pytest.mark.parametrize("method", ["autoregressive", "prompt_lookup", "lookahead"])
def test_chat_equals_hf_generate_on_the_templated_ids(model, tokenizer, method):
    ids = templated(tokenizer)
    reference = hf_greedy(model, ids, NEW)[0, ids.shape[1] :].tolist()
    assert len(reference) == NEW  # no early stop: every token is compared
    out = engine_for(model, tokenizer, method).chat(MESSAGES, max_new_tokens=NEW)
    assert out.token_ids == reference
    assert out.text == tokenizer.decode(reference, skip_special_tokens=True)
    assert out.stats.new_tokens == NEW


def test_chat_stream_pieces_join_to_the_reply(model, tokenizer):
    engine = engine_for(model, tokenizer, "prompt_lookup")
    pieces = list(engine.chat_stream(MESSAGES, max_new_tokens=NEW))
    assert len(pieces) > 1 and "".join(pieces) == engine.chat(MESSAGES, max_new_tokens=NEW).text


@pytest.mark.parametrize("method", ["autoregressive", "prompt_lookup"])
def test_the_generation_configs_eos_ends_the_reply(tokenizer, method):
    """The tokenizer's EOS is </s>; the generation config names another id, as chat models
    whose turns end with <|im_end|> do. Hugging Face stops on the generation config's: so
    does chat."""
    model = tiny_model("llama")
    ids = templated(tokenizer)
    free = hf_greedy(model, ids, NEW, eos_token_id=None)[0, ids.shape[1] :].tolist()
    stop_at = next(i for i in range(2, NEW) if free[i] not in free[:i] and free[i] != tokenizer.eos_token_id)
    model.generation_config.eos_token_id = free[stop_at]
    reference = hf_greedy(model, ids, NEW)[0, ids.shape[1] :].tolist()
    assert reference == free[: stop_at + 1]
    out = engine_for(model, tokenizer, method).chat(MESSAGES, max_new_tokens=NEW)
    assert out.token_ids == reference and out.stats.new_tokens == stop_at + 1


BAD_MESSAGES = [[], "hello", None, [{"role": "user"}], [{"content": "x"}], [("user", "x")],
                [{"role": "user", "content": 3}], [{"role": "", "content": "x"}], [MESSAGES[1], "x"]]


@pytest.mark.parametrize("messages", BAD_MESSAGES)
def test_bad_messages_are_refused(model, tokenizer, messages):
    engine = engine_for(model, tokenizer)
    with pytest.raises(ValueError, match=r"messages(\[\d\])? must be"):
        engine.chat(messages)
    with pytest.raises(ValueError, match=r"messages(\[\d\])? must be"):
        list(engine.chat_stream(messages))


def test_a_tokenizer_without_a_chat_template_says_so(model):
    engine = engine_for(model, tiny_tokenizer())
    with pytest.raises(ValueError, match="no chat template"):
        engine.chat(MESSAGES)


def test_a_template_refusing_the_messages_is_a_value_error(model):
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first turn must be the user') }}{% endif %}"
    engine = engine_for(model, chat_tokenizer(strict + TEMPLATE))
    with pytest.raises(ValueError, match="chat template refused these messages: the first turn must be the user"):
        engine.chat(MESSAGES)


# ---- hasten generate --chat, --device, --dtype, --threads ---------------------------------------
@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    path = save_checkpoint(tmp_path_factory.mktemp("chat"))
    chat_tokenizer().save_pretrained(path)
    return path




def test_a_saved_checkpoint_keeps_its_template_and_bos(chat_checkpoint, tokenizer):
    engine = hasten.load(chat_checkpoint, "autoregressive")
    assert engine.encode_chat(MESSAGES).tolist() == templated(tokenizer).tolist()


def test_cli_chat_equals_the_library_and_hf(chat_checkpoint, cli):
    code, out, err = cli("generate", "--model", chat_checkpoint, "--chat", "--system", SYSTEM, "--prompt", USER,
                         "--max-new-tokens", "12", "--json")
    assert code == 0, err
    record = json.loads(out)
    engine = hasten.load(chat_checkpoint, "autoregressive")
    expected = engine.chat(MESSAGES, max_new_tokens=12)
    assert record["token_ids"] == expected.token_ids and record["text"] == expected.text
    assert record["chat"] is True and record["method"] == "prompt_lookup" and record["threads"] == 1
    ids = engine.encode_chat(MESSAGES)
    assert record["token_ids"] == hf_greedy(engine.model, ids, 12)[0, ids.shape[1] :].tolist()


def test_cli_chat_streams_the_reply_of_one_user_message(chat_checkpoint, cli):
    code, out, err = cli("generate", "--model", chat_checkpoint, "--chat", "--prompt", USER, "--max-new-tokens", "10")
    assert code == 0, err
    expected = hasten.load(chat_checkpoint, "autoregressive").chat([MESSAGES[1]], max_new_tokens=10)
    assert out == expected.text + "\n"
    assert err.startswith("[prompt_lookup] tau ") and err.rstrip().endswith("| 1 thread")


@pytest.mark.parametrize("args, match", [
    (["--prompt", "x", "--system", "be brief"], "--system needs --chat"),
    (["--prompt", "x", "--threads", "-1"], "--threads must be >= 0"),
    (["--prompt", "x", "--dtype", "float8"], "invalid choice"),
])
def test_cli_runtime_errors_are_one_line(chat_checkpoint, cli, args, match):
    code, _, err = cli("generate", "--model", chat_checkpoint, *args)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1


def test_cli_chat_without_a_template_says_so(tmp_path, cli):
    plain = save_checkpoint(tmp_path / "plain")
    code, _, err = cli("generate", "--model", plain, "--chat", "--prompt", "x")
    assert code == 2 and "no chat template" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("device, match", [
    ("cuda", "--device cuda: CUDA is not available"),
    ("cuda:1", "--device cuda:1: CUDA is not available"),
    ("mps", "--device mps: Apple's MPS backend is not available"),
    ("tpu", "--device tpu: unknown device"),
    ("cpu:0", "--device cpu:0: unknown device"),
])
def test_an_unusable_device_is_one_line_before_any_loading(monkeypatch, cli, device, match):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    # the model does not exist: the device must be refused first, not "could not be loaded"
    code, _, err = cli("generate", "--model", "/no/such/model", "--prompt", "x", "--device", device)
    assert code == 2
    assert err.startswith(f"hasten: error: {match}")
    assert len(err.strip().splitlines()) == 1 and "could not be loaded" not in err


def test_device_and_dtype_reach_the_loader(chat_checkpoint, monkeypatch, cli):
    import hasten.cli

    loaded = {}

    def spy(*args, **kwargs):
        loaded.update(kwargs, engine=hasten.load(*args, **kwargs))
        return loaded["engine"]

    monkeypatch.setattr(hasten.cli, "load", spy)
    code, _, err = cli("generate", "--model", chat_checkpoint, "--prompt", USER, "--max-new-tokens", "4",
                       "--device", "cpu", "--dtype", "bfloat16")
    assert code == 0, err
    assert loaded["device"] == "cpu" and loaded["dtype"] is torch.bfloat16
    assert loaded["engine"].model.dtype == torch.bfloat16


@pytest.mark.parametrize("threads", [None, 2, 0])
def test_threads_are_applied_and_reported(chat_checkpoint, cli, threads):
    expected = {None: 1, 2: 2, 0: os.cpu_count()}[threads]
    args = [] if threads is None else ["--threads", str(threads)]
    torch.set_num_threads(2 if threads is None else 1)  # so that every case changes the count
    try:
        code, _, err = cli("generate", "--model", chat_checkpoint, "--prompt", USER, "--max-new-tokens", "4", *args)
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(1)  # the suite's setting (conftest)
    assert code == 0, err
    assert used == expected
    assert err.rstrip().endswith(f"| {expected} thread{'' if expected == 1 else 's'}")


def test_generate_help_documents_the_new_flags(cli):
    code, out, _ = cli("generate", "--help")
    assert code == 0
    for flag in ["--chat", "--system", "--device", "--dtype", "--threads"]:
        assert flag in out
    assert "default 1" in out and "bfloat16" in out and "cuda:N" in out
