"""hasten.load / Engine and the `hasten generate` command."""
import json
import subprocess
import sys
import warnings

import pytest

import hasten
from hasten.version import __version__
from helpers import VOCAB, save_checkpoint
from hasten.core.errors import HastenWarning


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory, checkpoint):
    from transformers import AutoTokenizer

    path = save_checkpoint(tmp_path_factory.mktemp("draft"), seed=4)
    # the target's own tokenizer (two trainings of the test tokenizer may number tokens differently)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(path)
    return path


PROMPT = "def add(a, b):\n    return a + b\n\ndef add("


@pytest.mark.parametrize("method", ["autoregressive", "prompt_lookup", "draft_model"])
def test_engine_methods_agree_with_plain_decoding(checkpoint, draft_checkpoint, method):
    plain = hasten.load(checkpoint, "autoregressive").generate(PROMPT, max_new_tokens=20)
    engine = hasten.load(checkpoint, method, draft=draft_checkpoint if method == "draft_model" else None)
    out = engine.generate(PROMPT, max_new_tokens=20)
    assert out.token_ids == plain.token_ids and out.text == plain.text
    assert out.stats.new_tokens == len(out.token_ids) == 20


def test_stream_pieces_join_to_the_text(checkpoint):
    engine = hasten.load(checkpoint, "prompt_lookup", num_tokens=4)
    assert engine.drafter.settings.num_tokens == 4
    pieces = list(engine.stream(PROMPT, max_new_tokens=20))
    assert len(pieces) > 1 and "".join(pieces) == engine.generate(PROMPT, max_new_tokens=20).text


def test_stopping_a_stream_early_leaves_the_engine_usable(checkpoint, draft_checkpoint):
    engine = hasten.load(checkpoint, "draft_model", draft=draft_checkpoint)
    full = engine.generate(PROMPT, max_new_tokens=16)
    stream = engine.stream(PROMPT, max_new_tokens=16)
    next(stream)
    stream.close()
    assert engine.generate(PROMPT, max_new_tokens=16).token_ids == full.token_ids


def test_engine_sampling_is_reproducible_with_a_seed(checkpoint):
    engine = hasten.load(checkpoint, "prompt_lookup")
    a = engine.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=3)
    b = engine.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=3)
    assert a.token_ids == b.token_ids


def test_engine_errors(checkpoint):
    engine = hasten.load(checkpoint, "autoregressive")
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate("")
    with pytest.raises(ValueError, match="needs a draft model"):
        hasten.load(checkpoint, "draft_model")
    with pytest.raises(ValueError, match="unknown method 'telepathy'; known: default, autoregressive, "):
        hasten.load(checkpoint, "telepathy")
    for bad_seed in ("3", True, 1.5):
        with pytest.raises(TypeError, match="seed must be an int"):
            engine.generate(PROMPT, max_new_tokens=2, seed=bad_seed)


def test_a_draft_model_for_a_method_without_one_is_refused_before_loading(draft_checkpoint):
    for method in ("prompt_lookup", "autoregressive"):
        with pytest.raises(ValueError, match=f"method '{method}' takes no draft model .*draft_model"):
            hasten.load("/no/such/model", method, draft=draft_checkpoint)  # the model is never loaded
    with pytest.raises(ValueError, match="needs a draft model: pass draft=PATH"):
        hasten.load("/no/such/model", "draft_model")
    with pytest.raises(ValueError, match="takes no draft model"):
        hasten.api.make_drafter("prompt_lookup", hasten.load(draft_checkpoint, "autoregressive").model)


def other_tokenizer():
    """Same vocabulary size as the test tokenizer, other tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0")


@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory):
    path = save_checkpoint(tmp_path_factory.mktemp("foreign"), seed=4)
    other_tokenizer().save_pretrained(path)
    return path


def test_a_draft_with_another_tokenizer_warns(checkpoint, draft_checkpoint, foreign_draft):
    with pytest.warns(HastenWarning, match=r"another tokenizer than the target \(\d+ of \d+ sampled ids differ"):
        engine = hasten.load(checkpoint, "draft_model", draft=foreign_draft)
    plain = hasten.load(checkpoint, "autoregressive").generate(PROMPT, max_new_tokens=8)
    assert engine.generate(PROMPT, max_new_tokens=8).token_ids == plain.token_ids  # still exact
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)  # the same tokenizer: no warning
        hasten.load(checkpoint, "draft_model", draft=draft_checkpoint)




def test_cli_streams_text_and_stats(checkpoint, cli):
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "10")
    assert code == 0, err
    assert "tau" in err and "tok/s" in err and "steps" in err
    expected = hasten.load(checkpoint, "autoregressive").generate(PROMPT, max_new_tokens=10)
    assert out == expected.text + "\n"


def test_stop_strings_cut_the_text_in_the_library_the_stream_and_the_cli(checkpoint, cli):
    engine = hasten.load(checkpoint, "prompt_lookup")
    full = engine.generate(PROMPT, max_new_tokens=24).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]  # two characters of what it writes
    expected = full[: full.index(stop)]
    out = engine.generate(PROMPT, max_new_tokens=24, stop=[stop, "never written"])
    assert out.text == expected and len(out.token_ids) < 24
    assert "".join(engine.stream(PROMPT, max_new_tokens=24, stop=[stop])) == expected
    code, printed, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "24",
                             "--stop", stop.replace("\n", "\\n"), "--json")
    assert code == 0, err
    assert json.loads(printed)["text"] == expected


def test_cli_takes_the_distribution_transforms(checkpoint, cli):
    rules = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, min_tokens=5)
    code, printed, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "12",
                             "--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "0.4",
                             "--min-tokens", "5", "--json")
    assert code == 0, err
    expected = hasten.load(checkpoint, "prompt_lookup").generate(PROMPT, max_new_tokens=12, **rules)
    assert json.loads(printed)["token_ids"] == expected.token_ids
    assert expected.token_ids != hasten.load(checkpoint, "prompt_lookup").generate(PROMPT, max_new_tokens=12).token_ids


def test_python_dash_m_hasten_prints_the_version():
    run = subprocess.run([sys.executable, "-m", "hasten", "--version"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"hasten {__version__}" == f"hasten {hasten.__version__}"


def test_cli_json_matches_library(checkpoint, tmp_path, cli):
    prompt_file = tmp_path / "p.txt"
    prompt_file.write_text(PROMPT)
    code, out, err = cli("generate", "--model", checkpoint, "--prompt-file", str(prompt_file), "--max-new-tokens", "10",
                         "--method", "prompt_lookup", "--method-arg", "num_tokens=3", "--json")
    assert code == 0, err
    record = json.loads(out)
    expected = hasten.load(checkpoint, "autoregressive").generate(PROMPT, max_new_tokens=10)
    assert record["token_ids"] == expected.token_ids and record["text"] == expected.text
    assert record["stats"]["new_tokens"] == 10 and record["method"] == "prompt_lookup"
    assert record["finish_reason"] == expected.finish_reason == "length"


def test_cli_json_names_why_generation_ended_as_the_server_does(checkpoint, cli):
    """finish_reason: "length" at --max-new-tokens, "stop" at EOS or a stop string (OpenAI's names)."""
    engine = hasten.load(checkpoint, "autoregressive")
    free = engine.generate(PROMPT, max_new_tokens=6)
    stop = engine.tokenizer.decode(free.token_ids[2:4])  # text that the third and fourth tokens make
    for args, reason in ((["--max-new-tokens", "6"], "length"), (["--max-new-tokens", "6", "--stop", stop], "stop")):
        code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--json", *args)
        assert code == 0, err
        assert json.loads(out)["finish_reason"] == reason
        assert engine.generate(PROMPT, max_new_tokens=6, stop=args[3:]).finish_reason == reason
        assert engine.generate_batch([PROMPT], max_new_tokens=6, stop=args[3:])[0].finish_reason == reason


def test_cli_reads_the_prompt_from_standard_input(checkpoint, cli, monkeypatch):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    code, out, err = cli("generate", "--model", checkpoint, "--prompt-file", "-", "--max-new-tokens", "5", "--json")
    assert code == 0, err
    assert json.loads(out)["text"] == hasten.load(checkpoint, "autoregressive").generate(PROMPT, max_new_tokens=5).text


@pytest.mark.parametrize("flags, named", [(["--top-k", "5", "--seed", "3"], "--top-k, --seed have"),
                                          (["--min-p", "0.5"], "--min-p has"), (["--top-p", "0.9"], "--top-p has")])
def test_sampling_flags_without_a_temperature_get_a_one_line_note(checkpoint, cli, flags, named):
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "3", *flags)
    assert code == 0
    notes = [line for line in err.splitlines() if line.startswith("hasten: warning:")]
    assert notes == [f"hasten: warning: {named} no effect without --temperature > 0: decoding is greedy"]
    code, _, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "3",
                       "--temperature", "0.7", *flags)
    assert code == 0 and "warning" not in err


def test_loading_shows_no_progress_bar(checkpoint, capfd):
    """transformers' "Loading weights" bar on every hasten.load told a user nothing."""
    from transformers.utils import logging

    before = logging.is_progress_bar_enabled()  # the command line turns the bars off for its process
    logging.enable_progress_bar()
    try:
        hasten.load(checkpoint, "autoregressive")
        assert "Loading weights" not in capfd.readouterr().err
        assert logging.is_progress_bar_enabled()  # the caller's setting, as it was
    finally:
        if not before:
            logging.disable_progress_bar()


def test_errors_name_the_model_as_the_user_did(tmp_path, cli):
    """An error about the model names what was passed (zoo:code-tiny), not the cache directory
    it resolves to."""
    image = tmp_path / "x.png"
    image.write_bytes(b"not read")
    for chat in ([], ["--chat"]):
        code, _, err = cli("generate", "--model", "zoo:code-tiny", "--prompt", "x", "--image", str(image), *chat)
        assert code == 2 and err == "hasten: error: images given, but zoo:code-tiny is a text-only model\n"


def test_model_help_names_every_kind_of_model(cli):
    code, out, _ = cli("generate", "--help")
    help_text = " ".join(out.split())
    assert code == 0 and ".gguf file" in help_text and "zoo:smollm2-135m" in help_text and "toy" in help_text


@pytest.mark.parametrize(
    "args, match",
    [
        (["--model", "/no/such/dir", "--prompt", "x"], "could not be loaded"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--prompt", "x", "--top-p", "2"], "top_p"),
        (["--prompt", "x", "--repetition-penalty", "0"], "repetition_penalty"),
        (["--prompt", "x", "--min-p", "1.5"], "min_p"),
        (["--prompt", "x", "--max-new-tokens", "-3"], "--max-new-tokens must be >= 1"),
        (["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),  # as the server's max_tokens
        (["--prompt", "x", "--method", "draft_model"], "needs a draft model"),
        (["--prompt-file", "/no/such/file"], "prompt-file"),
        (["--prompt", "x", "--method", "prompt_lookup", "--method-arg", "speed=9"], "KEY=VALUE"),
        (["--prompt", "x", "--method-arg", "num_tokens=4"], "belong to a named method"),
        (["--prompt", "x", "--method", "nonsense"], "invalid choice"),
        (["--prompt", "x", "--temperature", "nan"], "temperature"),
        (["--prompt", "x", "--temperature", "inf"], "temperature"),
        (["--prompt", "def", "--max-new-tokens", "600"], "max_new_tokens=600 does not fit"),
        (["--prompt", PROMPT * 60, "--max-new-tokens", "1"], "more than the model's context of 512 positions"),
        (["--prompt", "x", "--draft", "/no/such/draft"], "method 'prompt_lookup' takes no draft model"),
        (["--prompt", "x", "--method", "draft_model", "--draft", "/no/such/draft"], "could not be loaded"),
    ],
)
def test_cli_errors_are_one_line_and_exit_2(checkpoint, args, match, cli):
    if "--model" not in args:
        args = ["--model", checkpoint, *args]
    code, _, err = cli("generate", *args)
    assert code == 2
    assert match in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_generate_help_documents_every_flag(cli):
    code, out, _ = cli("generate", "--help")
    assert code == 0
    for flag in ["--model", "--method", "--draft", "--prompt", "--prompt-file", "--max-new-tokens",
                 "--temperature", "--top-k", "--top-p", "--seed", "--json", "--method-arg"]:
        assert flag in out
    assert "--draft PATH" in out and "draft=" not in out


def test_a_missing_draft_model_is_named_in_cli_terms(checkpoint, cli):
    code, _, err = cli("generate", "--model", "/no/such/model", "--prompt", "x", "--method", "draft_model")
    assert code == 2 and "--draft PATH" in err


def test_cli_warnings_are_one_readable_line(checkpoint, foreign_draft, cli):
    shown = warnings.showwarning
    code, _, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "4",
                       "--method", "draft_model", "--draft", foreign_draft)
    assert code == 0, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("hasten: warning: draft model ") and "another tokenizer" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("[draft_model] tau")  # no source line, no "UserWarning"
    assert "UserWarning" not in err and "warnings.warn" not in err
    assert warnings.showwarning is shown  # put back after the command


def test_untrained_weights_warning_is_one_line(checkpoint, cli):
    code, _, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "4",
                       "--method", "medusa")
    assert code == 0, err
    warned = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(warned) == 1 and warned[0].startswith("hasten: warning: no medusa weights found")
    assert "UserWarning" not in err


@pytest.mark.parametrize("command", [["bench", "--model", "/no/such/model"], ["diffusion", "bench"],
                                     ["train", "medusa", "--model", "/no/such/model", "--data", "DATA"]])
@pytest.mark.parametrize("where", ["a file", "below a file"])
def test_out_is_checked_before_anything_runs(command, where, tmp_path, cli):
    existing = tmp_path / "results.json"
    existing.write_text("keep me")
    data = tmp_path / "code.txt"
    data.write_text(PROMPT)
    out = existing if where == "a file" else existing / "sub"
    code, _, err = cli(*[str(data) if arg == "DATA" else arg for arg in command], "--out", str(out))
    assert code == 2  # and not "could not be loaded": --out is checked first
    message = "exists and is not a directory" if where == "a file" else "cannot write there (Not a directory)"
    assert err == f"hasten: error: --out {out}: {message}\n"
    assert existing.read_text() == "keep me"


def test_engine_generate_batch_equals_one_by_one(checkpoint):
    engine = hasten.load(checkpoint, "prompt_lookup")
    prompts = [PROMPT, "for i in range(10):\n", PROMPT[:12]]
    alone = [engine.generate(p, max_new_tokens=12) for p in prompts]
    together = engine.generate_batch(prompts, max_new_tokens=12, max_batch=2)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert [o.text for o in together] == [o.text for o in alone]
    stop = alone[0].text[3:5]
    cut = engine.generate_batch(prompts[:1], max_new_tokens=12, stop=[stop])[0]
    assert cut.text == engine.generate(PROMPT, max_new_tokens=12, stop=[stop]).text
    sampled = engine.generate_batch(prompts, max_new_tokens=6, temperature=1.0, seed=3)
    assert [o.token_ids for o in sampled] == [o.token_ids for o in engine.generate_batch(
        prompts, max_new_tokens=6, temperature=1.0, seed=3)]
    with pytest.raises(ValueError, match="prompts"):
        engine.generate_batch([])


def test_an_unknown_backend_is_refused_before_loading():
    with pytest.raises(ValueError, match="backend"):
        hasten.load("/no/such/model", "prompt_lookup", backend="vllm")


def test_auto_dtype_is_bfloat16_where_the_cpu_has_it_and_says_so(checkpoint, cli, monkeypatch):
    """--dtype auto (the default): float32 where the CPU has no native bfloat16 instructions
    (silently, as always), bfloat16 where it has them (vLLM's CPU default), in one line; the
    output then equals hasten's own plain decoding in bfloat16."""
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "6", "--json")
    assert code == 0 and json.loads(out)["dtype"] == "float32" and "dtype" not in err
    monkeypatch.setattr("hasten.arguments.native_bfloat16", lambda: "AVX512-BF16")
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "6", "--json",
                         "--method", "prompt_lookup")
    record = json.loads(out)
    assert code == 0 and record["dtype"] == "bfloat16"
    assert err.count("\n") == 1 and err.startswith("hasten: dtype bfloat16 (auto: this CPU has native bfloat16 "
                                                   "instructions, AVX512-BF16;")
    plain = hasten.load(checkpoint, "autoregressive", dtype="bfloat16").generate(PROMPT, max_new_tokens=6)
    assert record["token_ids"] == plain.token_ids
    code, out, _ = cli("generate", "--model", checkpoint, "--prompt", PROMPT, "--max-new-tokens", "6", "--json",
                       "--dtype", "float32")
    assert json.loads(out)["dtype"] == "float32"
    assert "auto (default): bfloat16 on a CPU with native bfloat16" in " ".join(cli("generate", "--help")[1].split())
