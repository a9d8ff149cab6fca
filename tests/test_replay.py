"""hasten record / replay: recorded greedy outputs replayed through the real step, drafters and
sizing rules, forwards priced by the recorded cost curve."""
import json

import pytest
import torch

from hasten.bench.replay import Recorded, Recording, copy_bound, longest_copies, record, replay
from hasten.drafters import Lookahead, PromptLookup
from hasten.engine.loop import generate
from hasten.engine.calibration import CostCurve
from hasten.engine.sizing import CostAwareSize, FixedSize

from helpers import repetitive_prompt, save_checkpoint, tiny_model

FLAT = CostCurve((1, 64), (1.0, 1.0))  # every forward one (simulated) second, whatever its size
STEEP = CostCurve((1, 2, 4, 8, 16), (1.0, 2.0, 3.0, 4.7, 8.6))  # llama.cpp on a CPU, SmolLM2 Q4_0


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def recording(model):
    prompts = [("a", repetitive_prompt(24, seed=0)[0].tolist()), ("b", repetitive_prompt(30, seed=1)[0].tolist())]
    return record(model, prompts, 40, "tiny", "torch", progress=False, curve=STEEP)


@pytest.mark.parametrize("make", [lambda: PromptLookup(), lambda: PromptLookup(num_tokens=4, min_ngram=2),
                                  lambda: Lookahead()])
def test_a_replay_takes_exactly_the_steps_of_the_real_run(model, recording, make):
    for entry in recording.entries:
        real = generate(model, torch.tensor([entry.prompt]), drafter=make(), max_new_tokens=len(entry.output),
                        eos_token_id=[], draft_size="fixed")
        assert real.sequences[0, len(entry.prompt):].tolist() == entry.output
        replayed = replay(recording, entry, make(), FixedSize())
        assert replayed.tokens == entry.output
        for field in ("steps", "new_tokens", "drafted_tokens", "accepted_tokens", "drafted_at_depth",
                      "accepted_at_depth"):
            assert getattr(replayed.stats, field) == getattr(real.stats, field), field


def test_the_recording_is_the_model_s_greedy_output(model, recording):
    for entry in recording.entries:
        plain = generate(model, torch.tensor([entry.prompt]), max_new_tokens=40, eos_token_id=[])
        assert plain.sequences[0, len(entry.prompt):].tolist() == entry.output
    assert recording.vocab_size == model.config.vocab_size and recording.trees_ok


def test_forwards_take_the_curve_s_time(recording):
    # an hour a forward, whatever its size: the loop's own (real) Python is lost beside it
    slow = Recording(recording.model, "torch", recording.vocab_size, True, CostCurve((1, 64), (3600.0, 3600.0)),
                     recording.entries)
    entry = slow.entries[0]
    plain = replay(slow, entry, None, FixedSize())
    assert plain.stats.steps == len(entry.output)
    assert plain.seconds == pytest.approx(3600.0 * plain.stats.steps, rel=1e-4)
    drafted = replay(slow, entry, PromptLookup(), FixedSize())
    assert drafted.stats.steps < plain.stats.steps
    assert drafted.seconds == pytest.approx(3600.0 * drafted.stats.steps, rel=1e-4)


def test_auto_sizing_replays_against_the_recorded_curve(recording):
    entry = recording.entries[0]
    fixed = replay(recording, entry, PromptLookup(), FixedSize())
    auto = replay(recording, entry, PromptLookup(), CostAwareSize(recording.curve))
    assert auto.tokens == fixed.tokens == entry.output
    # on a steep curve a block costs nearly its size in steps: auto drafts shallower than fixed
    assert auto.stats.drafted_tokens < fixed.stats.drafted_tokens


def test_a_chain_only_target_verifies_a_tree_draft_s_main_chain(recording):
    chains = Recording(recording.model, "llama.cpp", recording.vocab_size, False, recording.curve, recording.entries)
    replayed = replay(chains, chains.entries[0], Lookahead(), FixedSize())
    assert replayed.stats.drafted_tokens == sum(replayed.stats.drafted_at_depth) > 0  # one node per depth
    trees = replay(recording, recording.entries[0], Lookahead(), FixedSize())
    assert trees.stats.drafted_tokens > sum(trees.stats.drafted_at_depth)  # lookahead drafts trees


def test_drafters_that_read_features_are_refused(recording):
    from hasten.drafters.medusa import Medusa

    with pytest.raises(ValueError, match="reads the target's features"):
        replay(recording, recording.entries[0], Medusa(), FixedSize())


def test_longest_copies_and_the_copy_bound():
    entry = Recorded("x", [5, 6, 7, 8, 9], [6, 7, 8, 1, 9])
    # 6 7 8 is in the prompt; then 7 8 (in the prompt), 8, 1 (nowhere before it), 9
    assert longest_copies(entry) == [3, 2, 1, 0, 1]
    flat = Recording("m", "torch", 16, True, FLAT, [entry])
    # with free blocks the oracle drafts 6 7 8 | 1 (bonus) in one forward, then 9: two forwards
    assert copy_bound(flat, entry) == 2.0
    steep = Recording("m", "torch", 16, True, CostCurve((1, 2, 4), (1.0, 2.5, 5.0)), [entry])
    assert copy_bound(steep, entry) == 5.0  # drafting never pays on this curve: five plain steps


def test_a_recording_survives_a_round_trip(tmp_path, recording):
    path = tmp_path / "rec.json"
    recording.save(path)
    again = Recording.load(path)
    assert again.curve == recording.curve and again.entries == recording.entries
    assert (again.model, again.backend, again.vocab_size, again.trees_ok) == ("tiny", "torch", recording.vocab_size, True)


def test_cli_record_then_replay(tmp_path, cli):
    model = save_checkpoint(tmp_path / "model")
    path = tmp_path / "rec.json"
    code, _, err = cli("record", "--model", model, "--tasks", "complete", "--per-task", "2",
                       "--max-new-tokens", "12", "--out", str(path), "--no-progress")
    assert code == 0, err
    saved = json.loads(path.read_text())
    assert [e["category"] for e in saved["entries"]] == ["complete", "complete"]
    assert all(len(e["output"]) == 12 for e in saved["entries"])
    code, out, err = cli("replay", str(path), "--methods", "prompt_lookup", "--method-arg", "num_tokens=4",
                         "--out", str(tmp_path / "out"), "--no-progress")
    assert code == 0, err
    header = next(line for line in out.splitlines() if line.startswith("| category"))
    assert header.split("|")[3:-1] == [" prompt_lookup ", " prompt_lookup@fixed ", " copy bound "]
    table = json.loads((tmp_path / "out" / "replay.json").read_text())["table"]
    assert (tmp_path / "out" / "replay.png").stat().st_size > 0 and (tmp_path / "out" / "replay.md").is_file()
    assert list(table) == ["complete", "overall"]
    assert all(row["copy bound"]["speedup"] >= 1.0 for row in table.values())


@pytest.mark.parametrize("args, message", [
    (["replay", "missing.json"], "cannot read the recording"),
    (["replay", "{bad}"], "make one with `hasten record`"),
    (["replay", "{rec}", "--methods", "medusa"], "reads the target's features"),
    (["replay", "{rec}", "--methods", "autoregressive"], "is the reference"),
    (["replay", "{rec}", "--methods", "nosuch"], "unknown method"),
    (["replay", "{rec}", "--draft-size", "big"], "--draft-size"),
    (["record", "--model", "zoo:code-tiny", "--out", "{dir}"], "is a directory"),
    (["record", "--model", "zoo:code-tiny", "--per-task", "0", "--out", "{rec}"], "--per-task must be >= 1"),
])
def test_cli_replay_errors_are_one_line(tmp_path, cli, recording, args, message):
    (tmp_path / "bad.json").write_text("[1, 2]")
    recording.save(tmp_path / "rec.json")
    args = [a.format(bad=tmp_path / "bad.json", rec=tmp_path / "rec.json", dir=tmp_path) for a in args]
    code, _, err = cli(*args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
