"""Replay recorded greedy outputs through real drafters and sizing rules, pricing each target
forward from the recorded cost curve instead of running the model.

Why: on a small shared machine a wall-clock comparison of two drafters or two sizing rules
swings from run to run by more than the changes it should tell apart (docs/benchmarks.md). Greedy decoding is
deterministic: once the target's greedy continuation of each prompt is known (:func:`record`),
a lossless method's steps depend on its drafts alone. A :class:`RecordedTarget` answers each
verification forward with logits whose argmax is the recorded continuation, and a
:class:`SimulatedClock` charges that forward the recorded curve's seconds for its block size.
The drafter, the sizing rule, the verifier and the decode step are the real ones
(:func:`hasten.engine.sequence.step`), so a replay takes exactly the steps a real greedy run
takes, and drafting and the loop's own Python are timed for real. Left out: how a busy
machine slows the forward (the curve was measured once), the prefill, and drafters that read
the target's features (medusa, eagle, ...): only drafters that read tokens replay.

:func:`copy_bound` is the speed no drafter that copies from its context can beat: at each
step an oracle drafts the longest stretch of the true continuation found anywhere in the
prompt and the text so far, exactly as deep as pays on the curve. Where it is near 1,
input-guided drafting cannot pay on that model and machine, whatever the sizing rule.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..core.runtime import Capability, Runtime
from ..core.stats import DecodeStats
from ..core.tree import TokenTree
from ..drafters.base import Drafter
from ..engine.loop import generate
from ..core.request import Request
from ..engine.planner import DraftPlanner
from ..engine.sequence import open_row, step
from ..engine.calibration import CostCurve, load_or_calibrate
from ..engine.sizing import SizingRule
from ..engine.verify import GreedyAcceptance
from ..models.adapter import ForwardOutput
from ..models.hf import runtime_of

FORMAT = "hasten-replay/1"


@dataclass
class Recorded:
    """One prompt and the target's greedy continuation of it (EOS ignored, as in the bench)."""

    category: str
    prompt: list[int]
    output: list[int]


@dataclass
class Recording:
    model: str
    backend: str  # "torch" or "llama.cpp"
    vocab_size: int
    trees_ok: bool  # whether the target verified tree drafts (llama.cpp: chains only)
    curve: CostCurve  # seconds of one forward per block size, on the machine it was recorded on
    entries: list[Recorded]
    about: dict = field(default_factory=dict)  # command, date, machine

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT, **asdict(self), "curve": {"sizes": self.curve.sizes, "seconds": self.curve.seconds}}
        Path(path).write_text(json.dumps(data))

    @classmethod
    def load(cls, path: str | Path) -> "Recording":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as err:
            raise ValueError(f"cannot read the recording {str(path)!r}: {err.strerror or err}") from None
        except json.JSONDecodeError:
            raise ValueError(f"{str(path)!r} is not a recording (not JSON); make one with `hasten record`") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is not a {FORMAT} recording; make one with `hasten record`")
        curve = CostCurve(tuple(data["curve"]["sizes"]), tuple(data["curve"]["seconds"]))
        entries = [Recorded(**entry) for entry in data["entries"]]
        return cls(data["model"], data["backend"], data["vocab_size"], data["trees_ok"], curve, entries,
                   data.get("about", {}))


def record(model, prompts: list[tuple[str, list[int]]], max_new_tokens: int, name: str, backend: str,
           progress: bool = True, curve: CostCurve | None = None) -> Recording:
    """The target's greedy continuation of every ``(category, prompt ids)`` and its cost curve
    on this machine (``curve``, else calibrated or read from the cache as ``draft_size="auto"``
    does)."""
    runtime = runtime_of(model)
    if runtime.encoder_decoder:
        raise ValueError("record replays decoder-only targets; this model is an encoder-decoder")
    curve = curve or load_or_calibrate(model)
    entries = []
    for category, ids in tqdm(prompts, desc="recording greedy outputs", unit="prompt", disable=not progress):
        out = generate(model, torch.tensor([ids]), max_new_tokens=max_new_tokens, eos_token_id=[], threads=None)
        entries.append(Recorded(category, list(ids), out.sequences[0, len(ids) :].tolist()))
    return Recording(name, backend, runtime.vocab_size, Capability.TREES in runtime.capabilities, curve, entries)


class SimulatedClock:
    """Real time, except that a recorded forward takes its curve's seconds instead of the
    (much shorter) time the replay spends building its logits."""

    def __init__(self):
        self.shift = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.shift

    def charge(self, seconds: float, real_began: float) -> None:
        self.shift += seconds - (time.perf_counter() - real_began)


class RecordedRuntime(Runtime):
    """What a recording knows of the model that made it: its name (lookahead's corpus key
    reads ``source``), vocabulary and whether it verified trees. It runs no forward."""

    name = "recording"
    context_length = None

    def __init__(self, recording: Recording):
        self.label = self.source = recording.model
        self.vocab_size = recording.vocab_size
        self.capabilities = frozenset({Capability.TREES}) if recording.trees_ok else frozenset()


class RecordedTarget:
    """A target that has already answered: its greedy choice at every position is the
    recorded sequence's next token. One sequence (a RowCache and a Target at once)."""

    encoder_decoder = False
    prompt_embeds = None
    kv_readable = False

    def __init__(self, recording: Recording, entry: Recorded, clock: SimulatedClock):
        self.reference = entry.prompt + entry.output
        self.vocab_size, self.trees_ok = recording.vocab_size, recording.trees_ok
        self.curve, self.clock = recording.curve, clock
        self.model = RecordedRuntime(recording)
        self.cache_length = len(entry.prompt) - 1  # the prompt is cached but its last token (the root)

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        self.cache_length = start + 1 + len(accepted)

    def crop(self, new_length: int) -> None:
        self.cache_length = new_length

    def forward_rows(self, rows, blocks: list[list[int]], trees: list[TokenTree], hidden: bool) -> list[ForwardOutput]:
        began = time.perf_counter()
        block, tree = blocks[0], trees[0]
        base, reference = self.cache_length, self.reference  # block[0] sits at position base
        logits = torch.zeros(len(block), self.vocab_size)  # [block, vocab]: one-hot at the greedy token
        on_path = {-1: True}  # node -> its path so far equals the reference
        depths = (0, *tree.depths)
        for node, (token, parent) in enumerate(zip(block[1:], tree.parents)):
            on_path[node] = on_path[parent] and base + depths[node + 1] < len(reference) \
                and token == reference[base + depths[node + 1]]
        for node, follows in on_path.items():
            nxt = base + depths[node + 1] + 1
            if follows and nxt < len(reference):
                logits[node + 1, reference[nxt]] = 1.0
        self.cache_length = base + len(block)
        self.clock.charge(self.curve(len(block)), began)
        return [ForwardOutput(logits, None)]


@dataclass
class Replayed:
    """A method's replay of one recorded prompt."""

    tokens: list[int]  # what it committed (equal to the recording: checked)
    stats: DecodeStats
    seconds: float  # simulated: recorded forwards plus real drafting and loop time


def check_replayable(drafter: Drafter | None) -> None:
    """ValueError for a drafter a recording cannot serve (plain decoding, None, always can)."""
    if drafter is not None and drafter.needs:
        needs = ", ".join(sorted(map(str, drafter.needs)))
        raise ValueError(f"{drafter.name} reads the target's features ({needs}), which a recording does not hold; "
                         "replay runs drafters that read tokens only (prompt_lookup, lookahead, or your own)")


def replay(recording: Recording, entry: Recorded, drafter: Drafter | None, sizing: SizingRule) -> Replayed:
    """Run ``drafter`` (None: plain decoding) with ``sizing`` over the recorded continuation."""
    check_replayable(drafter)
    clock = SimulatedClock()
    target = RecordedTarget(recording, entry, clock)
    stats = DecodeStats()
    request = Request(list(entry.prompt), len(entry.output), eos_token_ids=frozenset())  # greedy, no EOS
    planner = DraftPlanner(sizing)
    sequence = open_row(request, drafter, lambda features: (target, list(entry.prompt), None), planner,
                        GreedyAcceptance(), stats)
    sequence.clock = clock
    began = clock()
    while not sequence.finished:
        step(target, [sequence], planner)
    sequence.close()
    seconds = clock() - began
    if sequence.generated != entry.output:  # the loop is lossless; a mismatch means a broken recording
        raise AssertionError(f"replay of a {entry.category} prompt committed other tokens than recorded")
    return Replayed(sequence.generated, stats, seconds)


def longest_copies(entry: Recorded) -> list[int]:
    """For each output position p: the longest stretch of ``output[p:]`` that occurs in the
    prompt and the output before p."""
    to_text = lambda tokens: "".join(map(chr, tokens))  # noqa: E731  (ids are below 0x110000)
    full, start, found = to_text(entry.prompt + entry.output), len(entry.prompt), []
    for p in range(len(entry.output)):
        context, at, length = full[: start + p], start + p, 0
        while at + length < len(full) and full[at : at + length + 1] in context:
            length += 1
        found.append(length)
    return found


def copy_bound(recording: Recording, entry: Recorded) -> float:
    """Forward seconds of the best an oracle copier could do on ``entry`` (see the module doc):
    the cheapest way through the output when a step at p may draft up to ``longest_copies[p]``
    tokens, all accepted, and costs the curve's seconds for its block."""
    copies, curve, n = longest_copies(entry), recording.curve, len(entry.output)
    cost = [0.0] + [float("inf")] * n  # cost[p]: cheapest seconds to commit the first p tokens
    for p in range(n):
        for drafted in range(min(copies[p], n - p - 1) + 1):
            cost[p + drafted + 1] = min(cost[p + drafted + 1], cost[p] + curve(drafted + 1))
    return cost[n]
