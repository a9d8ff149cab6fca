"""Traces of the draft planner's decisions, to hold them fixed across refactors.

Synthetic recordings (prompts, and continuations that copy stretches of them between fresh
tokens) are replayed through the real step, the real drafters and the real cost-aware search,
with a clock that moves only when a forward runs (its price on a fixed cost curve) or a drafter
proposes (a fixed price per depth): so every decision is a pure function of the code, and a trace
(each row's depth asked, draft, accepted length and committed tokens per step, and the simulated
seconds) is the same on every machine. ``tests/data/planner_golden.json`` holds the traces the
code made before the planner was split out of the step (commit afc13c7); ``test_planner_golden``
replays them. ``python tests/planner_trace.py`` writes the file anew.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from hasten.core.cost import BatchCost, CostCurve
from hasten.core.request import Request
from hasten.core.stats import DecodeStats
from hasten.core.tree import TokenTree
from hasten.drafters import Lookahead, PromptLookup
from hasten.engine.verify import GreedyAcceptance
from hasten.models.adapter import ForwardOutput

import torch

GOLDEN = Path(__file__).parent / "data" / "planner_golden.json"
VOCAB = 96
# a one-row forward on a CPU (SmolLM2-like: a block of 8 costs a quarter more than one token)
TORCH_CURVE = CostCurve((1, 2, 4, 8, 16, 32), (0.030, 0.031, 0.033, 0.037, 0.045, 0.062))
# llama.cpp on a CPU: every block position costs most of a step
STEEP_CURVE = CostCurve((1, 2, 4, 8, 16), (0.010, 0.020, 0.030, 0.047, 0.086))
BATCH_COST = BatchCost(CostCurve((1, 2, 4, 8, 16), (0.030, 0.033, 0.038, 0.048, 0.070)), 2e-7, 64)


class TickClock:
    """Simulated seconds: a forward adds its price, a proposal its drafting price, nothing else."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def charge(self, seconds: float, real_began: float = 0.0) -> None:
        self.now += seconds


def timed(drafter, clock: TickClock):
    """``drafter`` whose proposals cost 0.4 ms plus 0.1 ms per depth asked, on ``clock``."""
    propose = drafter.propose

    def costed(ctx):
        clock.charge(0.0004 + 0.0001 * ctx.max_depth)
        return propose(ctx)

    drafter.propose = costed
    return drafter


def entries(seed: int, count: int, output_length: int = 64) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation) pairs: prompts of repeated phrases, continuations that copy a stretch
    of what came before (3-14 tokens) or write fresh tokens (1-8), in turns."""
    draw = random.Random(seed)
    found = []
    for _ in range(count):
        phrases = [[draw.randrange(3, VOCAB) for _ in range(draw.randrange(4, 12))] for _ in range(5)]
        prompt = [token for _ in range(draw.randrange(6, 14)) for token in draw.choice(phrases)]
        output: list[int] = []
        while len(output) < output_length:
            if draw.random() < 0.55:
                context = prompt + output
                start = draw.randrange(0, len(context) - 3)
                output.extend(context[start : start + draw.randrange(3, 15)])
            else:
                output.extend(draw.randrange(3, VOCAB) for _ in range(draw.randrange(1, 9)))
        found.append((prompt, output[:output_length]))
    return found


class Row:
    """One recorded row: a RowCache whose greedy token at every position is the recording's."""

    vocab_size = VOCAB
    encoder_decoder = False
    prompt_embeds = None
    kv_readable = False
    model = None

    def __init__(self, prompt: list[int], output: list[int], trees_ok: bool, packed: bool | None):
        self.reference = prompt + output
        self.trees_ok = trees_ok
        if packed is not None:
            self.packed_rows = packed
        self.cache_length = len(prompt) - 1

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        self.cache_length = start + 1 + len(accepted)

    def crop(self, new_length: int) -> None:
        self.cache_length = new_length

    def answer(self, block: list[int], tree: TokenTree) -> ForwardOutput:
        base, reference = self.cache_length, self.reference
        logits = torch.zeros(len(block), VOCAB)  # [block, vocab]: one-hot at the greedy token
        on_path = {-1: True}
        depths = (0, *tree.depths)
        for node, (token, parent) in enumerate(zip(block[1:], tree.parents)):
            at = base + depths[node + 1]
            on_path[node] = on_path[parent] and at < len(reference) and token == reference[at]
        for node, follows in on_path.items():
            nxt = base + depths[node + 1] + 1
            if follows and nxt < len(reference):
                logits[node + 1, reference[nxt]] = 1.0
        self.cache_length = base + len(block)
        return ForwardOutput(logits, None)


class Recorded:
    """The target of a replay: one forward answers every row, priced on the clock (one row: the
    curve at its block; packed rows: the batch cost at every row's positions and keys; padded
    rows: the curve at rows x widest block)."""

    def __init__(self, clock: TickClock, curve: CostCurve, packed: bool):
        self.clock, self.curve, self.packed = clock, curve, packed

    def forward_rows(self, rows, blocks, trees, hidden):
        if len(rows) == 1:
            seconds = self.curve(len(blocks[0]))
        elif self.packed:
            positions = sum(map(len, blocks))
            keys = sum(len(block) * row.cache_length for row, block in zip(rows, blocks))
            seconds = BATCH_COST.forward(self.curve, len(rows), positions, keys)
        else:
            seconds = self.curve(len(rows) * max(map(len, blocks)))
        outs = [row.answer(block, tree) for row, block, tree in zip(rows, blocks, trees)]
        self.clock.charge(seconds)
        self.last = [(block[1:], tree.parents) for block, tree in zip(blocks, trees)]
        return outs


DRAFTERS = {
    "prompt_lookup": lambda: PromptLookup(),
    "prompt_lookup_4_2": lambda: PromptLookup(num_tokens=4, min_ngram=2),
    "lookahead": lambda: Lookahead(),
}
CURVES = {"torch": TORCH_CURVE, "steep": STEEP_CURVE}
# (name, drafter, curve, rule, rows per step, packed, trees verified)
SCENARIOS = [
    *((f"one-{d}-{c}-{rule}", d, c, rule, 1, None, c == "torch") for d in DRAFTERS for c in CURVES
      for rule in ("auto", "fixed")),
    *((f"batch-{d}-{kind}", d, "torch", "auto", 4, kind == "packed", True) for d in DRAFTERS
      for kind in ("packed", "padded")),
    ("batch-prompt_lookup-steep-padded", "prompt_lookup", "steep", "auto", 3, False, False),
]


def trace(name: str, drafter: str, curve: str, rule: str, width: int, packed: bool | None, trees_ok: bool) -> dict:
    """Every step of a scenario: rows join ``width`` at a time, each as soon as one ends (the
    scheduler's order), one rule for all of them (its pool carries over, as in a server)."""
    from planner_api import open_sequence, run_step, sizing_for

    clock = TickClock()
    target = Recorded(clock, CURVES[curve], bool(packed))
    sizing = sizing_for(rule, CURVES[curve], BATCH_COST if packed else None)
    made = timed(DRAFTERS[drafter](), clock)
    waiting = list(enumerate(entries(seed=len(name), count=6)))
    running: list[tuple[int, object]] = []
    steps = []
    while waiting or running:
        while waiting and len(running) < width:
            index, (prompt, output) = waiting.pop(0)
            row = Row(prompt, output, trees_ok, packed)
            request = Request(list(prompt), len(output), eos_token_ids=frozenset())
            running.append((index, open_sequence(row, prompt, made, request, GreedyAcceptance(), DecodeStats(),
                                                 sizing, clock)))
        sequences = [sequence for _, sequence in running]
        news = run_step(target, sequences, sizing)
        asked = [sequence.ctx.max_depth for sequence in sequences]  # set by this step's proposal
        steps.append([[index, depth, list(tokens), list(parents), new]
                      for (index, _), depth, (tokens, parents), new in zip(running, asked, target.last, news)])
        for index, sequence in list(running):
            if sequence.finished:
                sequence.close()
                assert sequence.generated == entries(seed=len(name), count=6)[index][1]
        running = [(index, sequence) for index, sequence in running if not sequence.finished]
    return {"steps": steps, "seconds": round(clock.now, 9)}


def traces() -> dict:
    return {scenario[0]: trace(*scenario) for scenario in SCENARIOS}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    GOLDEN.write_text(json.dumps(traces()))
    print(f"wrote {GOLDEN}")
