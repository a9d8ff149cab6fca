"""``hasten serve`` with a drafter that learns across requests: one pool for every row, every row
its exact text, the pool in /metrics, a request field that opts out, and ``--pool FILE``."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvicorn", reason="hasten[serve] is not installed (pip install 'hasten[serve]')")

from hasten.api import Engine, make_drafter  # noqa: E402
from hasten.serve.app import ServeOptions, create_app, scheduler_factory  # noqa: E402
from helpers import tiny_model, tiny_tokenizer  # noqa: E402
from test_serve import KEY, NAME, NEW, PROMPTS, call, metrics, start_server, stop_server  # noqa: E402


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("llama"), tiny_tokenizer()


@pytest.fixture(scope="module")
def plain(model_and_tokenizer):
    """What every answer must be: the model's own greedy text."""
    model, tokenizer = model_and_tokenizer
    engine = Engine(model, tokenizer, None, "autoregressive")
    return {prompt: engine.generate(prompt, max_new_tokens=NEW).text for prompt in PROMPTS}


def serve(model_and_tokenizer, method: str, pool_file=None):
    model, tokenizer = model_and_tokenizer
    engine = Engine(model, tokenizer, make_drafter(method), method, draft_size="fixed")
    app = create_app(engine, scheduler_factory(engine, max_batch=4), ServeOptions(NAME, KEY, 1 << 16, pool_file=pool_file))
    server, thread, url = start_server(app)
    return engine, server, thread, url


def complete(url, prompt, **extra):
    status, body = call(url, "/v1/completions",
                        {"model": NAME, "prompt": prompt, "max_tokens": NEW, "temperature": 0, **extra})
    assert status == 200, body
    return body["choices"][0]["text"]


@pytest.mark.parametrize("method", ["lookahead", "suffix"])
def test_batched_rows_share_one_pool_and_each_gets_its_exact_text(model_and_tokenizer, plain, method):
    engine, server, thread, url = serve(model_and_tokenizer, method)
    try:
        for _ in range(2):  # the second round drafts from the first round's answers
            with ThreadPoolExecutor(8) as pool:
                texts = list(pool.map(lambda p: complete(url, p), PROMPTS))
            assert texts == [plain[p] for p in PROMPTS]
        stats = engine.drafter.pool.stats()
        assert stats.requests == 2 * len(PROMPTS) and stats.hits > 0
        seen = metrics(url)
        assert seen["hasten_pool_requests{}"] == 2 * len(PROMPTS) and seen["hasten_pool_entries{}"] > 0
        assert 0 < seen["hasten_pool_hit_rate{}"] <= 1 and seen["hasten_pool_hits_total{}"] == stats.hits
    finally:
        stop_server(server, thread)


def test_a_request_can_opt_out_of_the_pool(model_and_tokenizer, plain):
    engine, server, thread, url = serve(model_and_tokenizer, "lookahead")
    try:
        complete(url, PROMPTS[0])
        before = json.dumps(engine.drafter.pool.to_json())
        lookups = engine.drafter.pool.stats().lookups
        assert complete(url, PROMPTS[1], pool=False) == plain[PROMPTS[1]]
        assert json.dumps(engine.drafter.pool.to_json()) == before  # nothing written
        assert engine.drafter.pool.stats().lookups == lookups  # nothing read
        status, body = call(url, "/v1/completions", {"model": NAME, "prompt": "x", "pool": "no"})
        assert status == 400 and body["error"]["param"] == "pool"
    finally:
        stop_server(server, thread)


def test_a_pool_file_is_saved_at_exit_and_warms_the_next_server(model_and_tokenizer, plain, tmp_path):
    path = tmp_path / "pool.json"
    engine, server, thread, url = serve(model_and_tokenizer, "suffix", str(path))
    try:
        complete(url, PROMPTS[0])
    finally:
        stop_server(server, thread)
    assert json.loads(path.read_text())["kind"] == "suffix"
    engine, server, thread, url = serve(model_and_tokenizer, "suffix", str(path))
    try:
        assert metrics(url)["hasten_pool_entries{}"] > 0  # warm before any request
        assert complete(url, PROMPTS[0]) == plain[PROMPTS[0]]
        assert engine.drafter.pool.stats().hits > 0  # the saved answer drafted this one
    finally:
        stop_server(server, thread)
    with pytest.raises(ValueError, match="learns across requests"):
        model, tokenizer = model_and_tokenizer
        engine = Engine(model, tokenizer, make_drafter("prompt_lookup"), "prompt_lookup")
        create_app(engine, scheduler_factory(engine), ServeOptions(NAME, pool_file=str(path)))


def test_generate_learns_across_invocations_with_a_pool_file(cli, tmp_path):
    from helpers import save_checkpoint

    path, pool = save_checkpoint(tmp_path / "ckpt"), tmp_path / "pool.json"
    args = ("generate", "--model", path, "--method", "suffix", "--prompt", PROMPTS[0], "--max-new-tokens", "16",
            "--pool", str(pool), "--json", "--draft-size", "fixed")
    code, first, err = cli(*args)
    assert code == 0, err
    code, second, err = cli(*args)
    first, second = json.loads(first), json.loads(second)
    assert second["text"] == first["text"]
    assert second["stats"]["accepted_tokens"] > first["stats"]["accepted_tokens"]  # the saved answer drafted it
    code, _, err = cli("generate", "--model", path, "--prompt", "x", "--pool", str(pool))
    assert code == 2 and "learns across requests" in err
