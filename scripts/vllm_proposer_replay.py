"""Replay hasten.vllm's proposers on a recording, without vLLM: each request's recorded greedy
output is decoded as vLLM would call the proposer (one request at a time), each step's draft
checked against the recording and priced at ``1 + slope x (positions verified - 1)`` single
steps on the proposer's own clock, so its step-cost fit sees that line.

    hasten record --model zoo:smollm2-135m --tasks spec-bench --per-task 2 --max-new-tokens 96 \\
        --threads 1 --out smollm2.json
    python scripts/vllm_proposer_replay.py smollm2.json --slopes 0.01,0.025,0.05

Prints, per slope, each variant's tau and its speed-up over plain decoding in units of step cost.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from hasten.core.cost import CostCurve
from hasten.core.sizing import CostAwareSize
from hasten.vllm import FixedLookahead, FixedPromptLookup, Lookahead, PromptLookup

CONTEXT = 1 << 16

VARIANTS = {
    "prompt lookup, fixed 5": lambda: FixedPromptLookup(depth=5, max_model_len=CONTEXT),
    "prompt lookup, fixed 10": lambda: FixedPromptLookup(depth=10, max_model_len=CONTEXT),
    "prompt lookup, sized up to 10, with exploration draws": lambda: PromptLookup(
        depth=10, max_model_len=CONTEXT, rule=CostAwareSize(curve=CostCurve.flat(), explore_scale=1.0)),
    "prompt lookup, sized up to 10 (default)": lambda: PromptLookup(depth=10, max_model_len=CONTEXT),
    "lookahead, fixed 5": lambda: FixedLookahead(depth=5, max_model_len=CONTEXT),
    "lookahead, sized up to 10 (default)": lambda: Lookahead(depth=10, max_model_len=CONTEXT),
}


class Clock:
    """The proposer's clock: it moves only by the steps' prices."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(proposer, prompt: list[int], output: list[int], slope: float) -> tuple[int, int, float]:
    """(tokens after the first, steps, cost in single steps) of one request."""
    story = prompt + output
    clock = proposer.clock = Clock()
    table = np.zeros((1, len(story)), dtype=np.int64)
    table[0] = story
    length = len(prompt) + 1  # the prefill gave the first output token
    sampled, steps = [story[length - 1]], 0
    while length < len(story):
        draft = proposer.propose([sampled], np.array([length]), table)[0][: len(story) - length]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == story[length + accepted]:
            accepted += 1
        clock.now += 1.0 + slope * len(draft)
        sampled = story[length: length + accepted + 1]
        length += accepted + 1
        steps += 1
    return len(output) - 1, steps, clock.now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recording", help="a file written by `hasten record`")
    parser.add_argument("--slopes", default="0.01,0.025,0.05",
                        help="costs of one more verified position, in single steps (comma-separated)")
    args = parser.parse_args()
    entries = json.load(open(args.recording))["entries"]
    for slope in (float(s) for s in args.slopes.split(",")):
        print(f"step cost 1 + {slope} per verified position")
        for name, make in VARIANTS.items():
            tokens = steps = cost = 0
            for entry in entries:
                t, s, c = replay(make(), entry["prompt"], entry["output"], slope)
                tokens, steps, cost = tokens + t, steps + s, cost + c
            print(f"  {name:55s} tau {tokens / steps:.3f}  {tokens / cost:.3f}x plain")


if __name__ == "__main__":
    main()
