"""Processed log-probabilities (vLLM's ``processed_logprobs``): each emitted token scored under
the law it was drawn from (the request's logit rules, then its sampling transform), read from the
verification forward, equal to what a plain forward of the target gives under the same transform."""
import math

import torch

from hasten.core.sampling import Sampling
from hasten.drafters import PromptLookup
from hasten.engine.batch import Request, Scheduler

from helpers import repetitive_prompt, tiny_model


def scored_run(model, sampling, processed, seed=3, new=16):
    scheduler = Scheduler(model, PromptLookup(num_tokens=4), max_batch=1, draft_size="fixed")
    prompt = repetitive_prompt(24)[0].tolist()
    row = scheduler.submit(Request(prompt, new, sampling=sampling, seed=seed, logprobs=3,
                                   processed_logprobs=processed, eos_token_ids=frozenset()))
    tokens, scored, accepted = [], [], 0
    while scheduler.has_work():
        for update in scheduler.step():
            if update.row_id == row:
                tokens += update.tokens
                scored += update.logprobs or []
                accepted = update.stats.accepted_tokens
    return prompt, tokens, scored, accepted


def plain_rows(model, prompt, tokens):
    """[len(tokens), vocab] the target's logits for each emitted token's position, one plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def test_processed_logprobs_are_the_sampling_law_of_each_emitted_token():
    model = tiny_model("llama")
    sampling = Sampling(0.7, top_k=5, logit_bias=((3, 1.5),))
    prompt, tokens, scored, accepted = scored_run(model, sampling, processed=True)
    assert accepted > 0  # tokens were accepted from drafts, so block rows were scored
    rows = plain_rows(model, prompt, tokens)
    rows[:, 3] += 1.5  # the request's logit bias, then its sampling transform
    law = sampling.probs(rows).log()  # [len(tokens), vocab]
    assert [entry.token for entry in scored] == tokens
    for i, entry in enumerate(scored):
        assert math.isclose(entry.logprob, law[i, tokens[i]].item(), abs_tol=1e-4)
        top = law[i].topk(3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
    # top-k 5: the sixth likeliest token has no mass under the law the token was drawn from
    assert all(law[i].isinf().sum() == law.shape[1] - 5 for i in range(len(tokens)))


def test_raw_logprobs_ignore_the_transform_and_the_mode_changes_no_token():
    model = tiny_model("llama")
    sampling = Sampling(0.7, top_k=5)
    prompt, tokens, raw, _ = scored_run(model, sampling, processed=False)
    _, same_tokens, _, _ = scored_run(model, sampling, processed=True)
    assert same_tokens == tokens  # scoring never changes what is drawn
    logp = plain_rows(model, prompt, tokens).log_softmax(-1)
    assert all(math.isclose(e.logprob, logp[i, tokens[i]].item(), abs_tol=1e-4) for i, e in enumerate(raw))
