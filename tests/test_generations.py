"""One Engine serves any number of generations at once: a drafter's per-generation state
lives in the object its ``begin`` returns, never on the drafter (the server depends on it)."""
import warnings

import pytest

import hasten
from hasten.api import AUTOREGRESSIVE
from hasten.drafters import REGISTRY
from helpers import save_checkpoint

METHODS = [AUTOREGRESSIVE, *sorted(REGISTRY)]
PROMPTS = ["def add(a, b):\n    return a + b\n" * 2, "for i in range(10):\n    print(i)\n"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_checkpoint(root / "target", seed=0), save_checkpoint(root / "draft", seed=3)


def engine_for(method, checkpoints):
    target, draft = checkpoints
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untrained drafter weights: warned about elsewhere
        needs_draft = method in REGISTRY and REGISTRY[method].needs_draft_model
        return hasten.load(target, method, draft=draft if needs_draft else None)


def run_interleaved(engine, options):
    """Step two generations alternately until both end; returns their token ids."""
    streams = [engine.steps(prompt, hasten.DecodeStats(), **options) for prompt in PROMPTS]
    ids = [[] for _ in streams]
    live = set(range(len(streams)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while live:
            for i in sorted(live):
                try:
                    ids[i].extend(next(streams[i])[1])
                except StopIteration:
                    live.discard(i)
    return ids


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", METHODS)
def test_interleaved_generations_equal_sequential_ones(method, sampled, checkpoints):
    engine = engine_for(method, checkpoints)
    options = dict(max_new_tokens=20, temperature=0.9 if sampled else 0.0, seed=11 if sampled else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sequential = [engine.generate(prompt, **options).token_ids for prompt in PROMPTS]
    interleaved = run_interleaved(engine, options)
    assert interleaved == sequential
    assert all(sequential), "each generation produced tokens"
