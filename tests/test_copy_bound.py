"""scripts/copy_bound.py: the oracle copy drafter replayed over hand-made token streams (no model)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from copy_bound import (History, Replay, cheapest_seconds, copy_lengths, fewest_steps,  # noqa: E402
                        replay_stream, report)


def flat(k: int) -> float:  # a forward costs the same whatever its block size
    return 1.0


def test_the_longest_copy_is_a_span_of_the_history_within_the_cap():
    history = History()
    history.add([1, 2, 3, 4, 9, 1, 2, 3, 5])
    assert history.longest_copy([1, 2, 3, 5, 7], cap=10) == 4  # the second occurrence goes further
    assert history.longest_copy([1, 2, 3, 5, 7], cap=2) == 2
    assert history.longest_copy([7, 1], cap=10) == 0  # its first token is nowhere
    assert history.longest_copy([1, 2], cap=0) == 0


def test_no_copied_span_crosses_two_documents():
    history = History()
    history.add([1, 2])
    history.end_document()
    history.add([3, 4])
    assert history.longest_copy([1, 2, 3, 4], cap=10) == 2


def test_copy_lengths_grow_the_history_and_leave_the_last_slot_to_the_target():
    prompt = [5, 6, 7, 8]
    lengths = copy_lengths(History(), prompt, [5, 6, 7, 8, 5, 6], cap=64)
    # position 0 copies the whole prompt; position 1 copies [6, 7, 8] and the output's own first 5
    assert lengths == [4, 4, 3, 2, 1, 0]
    assert all(length <= 6 - i - 1 for i, length in enumerate(lengths))


def test_fewest_steps_and_cheapest_seconds_respect_the_depth_cap():
    lengths = copy_lengths(History(), list(range(20)), list(range(20)), cap=64)  # the output copies the prompt
    assert fewest_steps(lengths, depth=64) == 1
    assert fewest_steps(lengths, depth=4) == 4  # 5 tokens a step at most
    assert fewest_steps(lengths, depth=0) == 20
    assert cheapest_seconds(lengths, 4, flat) == 4.0
    # a forward that costs its block size gains nothing from drafting: plain decoding's time
    assert cheapest_seconds(lengths, 64, lambda k: float(k)) == 20.0


def test_cheapest_seconds_may_draft_shorter_than_the_longest_copy():
    # a block of 3 costs more than two blocks of 1, so the cheapest decode drafts nothing
    lengths = [2, 1, 0]
    assert fewest_steps(lengths, depth=8) == 1
    assert cheapest_seconds(lengths, 8, lambda k: {1: 1.0, 2: 1.5, 3: 10.0}[k]) == 2.5  # block of 2, then 1


def test_a_repeated_output_drafts_from_the_pool_and_not_per_request():
    prompts = [[100, 101], [200, 201]]
    answer = list(range(1, 17))  # the second prompt's output repeats the first's
    replays = replay_stream(prompts, [answer, answer], earlier=[], depths=[4, 16], cost=flat)
    first, second = (replays["per request"][16][i] for i in (0, 1))
    assert first.tau == second.tau == 1.0  # nothing to copy within one request
    assert replays["pooled"][16][0].tau == 1.0 and replays["pooled"][16][1].tau == 16.0
    assert replays["pooled"][4][1].tau == 16 / 4  # depth 4: 5 tokens a step at most, 4 steps
    assert replays["pooled"][16][1].speedup == 16.0


def test_earlier_documents_count_in_the_pool_only():
    answer = [7, 8, 9, 10]
    replays = replay_stream([[1]], [answer], earlier=[[50, *answer]], depths=[8], cost=flat)
    assert replays["per request"][8][0].steps == 4 and replays["pooled"][8][0].steps == 1


def test_the_report_answers_with_measured_results():
    tokens = {"settings": {"workload": "extraction", "max_new_tokens": 4, "model": "tiny"}, "names": ["a", "b"],
              "prompts": [[1, 2], [3, 4]], "outputs": [[5, 6, 7, 8], [5, 6, 7, 8]], "warmup": [[], []]}
    replays = replay_stream(tokens["prompts"], tokens["outputs"], [], [4], lambda k: 1.0 + 0.1 * k)

    def row(method, seconds, steps):
        return {"method": method, "seconds": seconds, "steps": steps, "tau": 4 / steps, "median_prefill_seconds": 0.5}

    rows = {name: {"autoregressive": row("autoregressive", 4.5, 4),
                   "lookahead_per_request": row("lookahead_per_request", 2.5, 2)} for name in tokens["names"]}
    text = report(tokens, replays, lambda k: 1.0 + 0.1 * k, rows)
    # prompt b: one oracle step of 4 tokens, 1.4 s against plain's 4 x 1.1 s: 0.5 + 4 / (4.4 / 1.4) s
    b = 0.5 + 4.0 * 1.4 / 4.4
    assert f"| pooled | 4 | {8 / 5:.2f} | " in text  # 4 steps + 1 step for 8 tokens
    assert f"at most {5.0 / (4.5 + b):.2f}x" in text and "no copy-based pooled drafter reaches 1.5x" in text
    assert isinstance(replays["pooled"][4][1], Replay)
