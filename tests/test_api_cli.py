"""hasten.load / Engine and the `hasten generate` command."""
import json
import subprocess
import sys

import pytest

import hasten
from helpers import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("draft"), seed=4)


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
    with pytest.raises(ValueError, match="unknown drafter"):
        hasten.load(checkpoint, "telepathy")


@pytest.fixture
def cli(capsys):
    """Run the command in-process (fast); returns (exit status, stdout, stderr)."""
    from hasten.cli import main

    def run(*args):
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_cli_entry_point_streams_text_and_stats(checkpoint):
    run = subprocess.run(
        [sys.executable, "-m", "hasten.cli", "generate", "--model", checkpoint, "--prompt", PROMPT,
         "--max-new-tokens", "10"], capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "tau" in run.stderr and "tok/s" in run.stderr and "steps" in run.stderr
    assert run.stdout.strip()


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


@pytest.mark.parametrize(
    "args, match",
    [
        (["--model", "/no/such/dir", "--prompt", "x"], "could not be loaded"),
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--prompt", "x", "--top-p", "2"], "top_p"),
        (["--prompt", "x", "--max-new-tokens", "-3"], "max_new_tokens"),
        (["--prompt", "x", "--method", "draft_model"], "needs a draft model"),
        (["--prompt-file", "/no/such/file"], "prompt-file"),
        (["--prompt", "x", "--method-arg", "speed=9"], "KEY=VALUE"),
        (["--prompt", "x", "--method", "nonsense"], "invalid choice"),
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
