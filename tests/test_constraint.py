"""Structured output is plain constrained decoding, token for token, under every drafter.

The reference is written from the definition with llguidance itself (not hasten's hook): at each
step the full forward's last logits, every token the grammar refuses at -inf, the EOS token allowed
exactly where the text is complete, the argmax; one token a step."""
import json
import math

import numpy as np
import pytest
import torch

import hasten
from hasten.core.constraint import ConstraintError
from hasten.drafters import REGISTRY, PromptLookup
from hasten.structured import Choice, Grammar, JsonSchema, Regex
from hasten.structured.llguidance import JSON_OPTIONS
from helpers import ScriptedDrafter, TreeScriptedDrafter, json_tokenizer, tiny_model

llguidance = pytest.importorskip("llguidance")

EOS = 2
NEW = 28
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
SPECS = {"json": JsonSchema(SCHEMA), "regex": Regex(r"[0-9]{2}-(yes|no)-[a-z]{2,4}"),
         "choice": Choice(["maybe", "yes", "no"])}
PROMPT_TEXT = '{"name": "ada", "age": 36, "ok": true} {"name": "alan", "age": 41, "ok": true} '


@pytest.fixture(scope="module")
def tokenizer():
    return json_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer))


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return torch.tensor([tokenizer.encode(PROMPT_TEXT)])


def ll_grammar(spec) -> str:
    kind = spec.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.schema_json, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.pattern)
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec.options))


def reference(model, tokenizer, prompt, spec, new=NEW) -> list[int]:
    """Plain constrained greedy decoding from the definition: mask, argmax, one token a step."""
    vocab = model.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), ll_grammar(spec),
                                   log_level=0)
    ids = prompt[0].tolist()
    out = []
    for _ in range(new):
        logits = model(torch.tensor([ids])).logits[0, -1]
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab].astype(bool))
        allowed[EOS] = matcher.is_accepting()
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        if token == EOS:
            break
        assert matcher.consume_token(token)
        ids.append(token)
    return out


@pytest.fixture(scope="module")
def references(model, tokenizer, prompt):
    return {name: reference(model, tokenizer, prompt, spec) for name, spec in SPECS.items()}


def generated(out, prompt) -> list[int]:
    return out.sequences[0, prompt.shape[1]:].tolist()


def test_the_reference_writes_valid_text(references, tokenizer):
    text = tokenizer.decode(references["json"], skip_special_tokens=True)
    assert json.loads(text).keys() == {"name", "age", "ok"}
    assert tokenizer.decode(references["choice"], skip_special_tokens=True) in ("maybe", "yes", "no")


@pytest.mark.parametrize("name", sorted(SPECS))
def test_plain_constrained_decoding_is_the_reference(model, tokenizer, prompt, references, name):
    out = hasten.generate(model, prompt, max_new_tokens=NEW, tokenizer=tokenizer, constraint=SPECS[name])
    assert generated(out, prompt) == references[name]
    assert out.stats.mean_accepted == 1.0 and out.stats.forced_tokens == 0


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode", ["oracle", "adversarial", 0, 1, 3])
def test_scripted_chains(model, tokenizer, prompt, references, name, mode):
    """Oracle, adversarial and planted-error drafts; a wrong token is either refused by the grammar
    (cut) or allowed and rejected by the verifier."""
    truth = prompt[0].tolist() + references[name]
    drafter = ScriptedDrafter(truth, 4, mode)
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, tokenizer=tokenizer,
                          constraint=SPECS[name], draft_size="fixed")
    assert generated(out, prompt) == references[name]
    if mode == "oracle":
        assert out.stats.steps < len(references[name])


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("error_at", [None, 0, 2])
@pytest.mark.parametrize("right_sibling", [0, 2])
def test_scripted_trees(model, tokenizer, prompt, references, name, error_at, right_sibling):
    truth = prompt[0].tolist() + references[name]
    drafter = TreeScriptedDrafter(truth, 4, 3, right_sibling, error_at)
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, tokenizer=tokenizer,
                          constraint=SPECS[name], draft_size="fixed")
    assert generated(out, prompt) == references[name]


def test_forced_text_is_proposed_and_counted(model, tokenizer, prompt, references):
    """With a method drafting, the schema's keys and punctuation arrive as forced drafts."""
    out = hasten.generate(model, prompt, drafter=PromptLookup(num_tokens=4), max_new_tokens=NEW, tokenizer=tokenizer,
                          constraint=SPECS["json"], draft_size="fixed")
    assert generated(out, prompt) == references["json"]
    assert out.stats.forced_tokens > 0 and 0 < out.stats.forced_share < 1
    assert out.stats.steps < len(references["json"])


def test_a_batch_mixes_grammars_and_unconstrained_rows(model, tokenizer, prompt, references):
    """Rows with different grammars beside an unconstrained row, each as it is alone."""
    from hasten.engine.batch import Request, Scheduler
    from hasten.core.sampling import Sampling

    free = hasten.generate(model, prompt, max_new_tokens=NEW).sequences[0, prompt.shape[1]:].tolist()
    scheduler = Scheduler(model, PromptLookup(num_tokens=4), max_batch=4, draft_size="fixed")
    ids = prompt[0].tolist()
    rows = {}
    for name in [*sorted(SPECS), None]:
        constraint = None if name is None else SPECS[name].compile(tokenizer, model.config.vocab_size)
        rows[scheduler.submit(Request(ids, NEW, Sampling(), eos_token_ids=frozenset({EOS}),
                                      constraint=constraint))] = name
    results = scheduler.run()
    for row_id, name in rows.items():
        assert results[row_id].tokens == (free if name is None else references[name]), name


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_every_registered_drafter(method, tmp_path_factory, tokenizer, references):
    """Every method, loaded as users load it, writes the reference under each constraint."""
    import warnings

    root = tmp_path_factory.getbasetemp() / "constraint-models"
    target, draft = root / "target", root / "draft"
    if not target.exists():
        tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(target)
        tiny_model("llama", seed=3, vocab_size=len(tokenizer)).save_pretrained(draft)
        tokenizer.save_pretrained(target)
        tokenizer.save_pretrained(draft)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # untrained drafter weights
        engine = hasten.load(str(target), method, draft=str(draft) if REGISTRY[method].needs_draft_model else None,
                             draft_size="fixed")
        for name, spec in SPECS.items():
            out = engine.generate(PROMPT_TEXT, max_new_tokens=NEW, constraint=spec)
            assert out.token_ids == references[name], (method, name)


def test_a_continuation_rebuilds_the_matcher(model, tokenizer, prompt, references):
    """A row moved to a fresh scheduler resumes from its committed tokens: the matcher replays them."""
    from hasten.engine.batch import Request, Scheduler
    from hasten.core.sampling import Sampling

    constraint = SPECS["json"].compile(tokenizer, model.config.vocab_size)
    done = references["json"][:9]
    scheduler = Scheduler(model, PromptLookup(num_tokens=4), draft_size="fixed")
    row = scheduler.submit(Request(prompt[0].tolist() + done, NEW - 9, Sampling(), eos_token_ids=frozenset({EOS}),
                                   resumed=9, constraint=constraint))
    assert done + scheduler.run()[row].tokens == references["json"]
    bad = Request(prompt[0].tolist() + [tokenizer.convert_tokens_to_ids("}")], 4, Sampling(),
                  eos_token_ids=frozenset({EOS}), resumed=1, constraint=constraint)
    scheduler.submit(bad)
    with pytest.raises(ConstraintError, match="does not follow the constraint"):
        scheduler.run()


def test_a_grammar_in_gbnf_and_lark(model, tokenizer, prompt):
    for text in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):
        out = hasten.generate(model, prompt, max_new_tokens=6, tokenizer=tokenizer, constraint=Grammar(text))
        assert tokenizer.decode(generated(out, prompt), skip_special_tokens=True) in ("yes", "no")


def test_max_tokens_ends_a_grammar_unfinished(model, tokenizer, prompt, references):
    out = hasten.generate(model, prompt, max_new_tokens=5, tokenizer=tokenizer, constraint=SPECS["json"])
    assert generated(out, prompt) == references["json"][:5] and out.finish_reason == "length"


def test_bad_constraints_are_refused_naming_the_field(model, tokenizer, prompt):
    cases = [
        (lambda: JsonSchema({"type": "object", "properties": {"a": {"type": "nonsense"}}}), "does not compile"),
        (lambda: Regex("(unclosed"), "does not compile"),
        (lambda: Grammar("start: undefined_rule"), "does not compile"),
        (lambda: JsonSchema({"description": "x" * (70 * 1024)}), "at most"),
        (lambda: Choice([]), "non-empty list"),
        (lambda: JsonSchema("{not json"), "not valid JSON"),
    ]
    for make, message in cases:
        with pytest.raises(ConstraintError, match=message) as err:
            hasten.generate(model, prompt, max_new_tokens=4, tokenizer=tokenizer, constraint=make())
        assert err.value.field == "constraint"
    with pytest.raises(ConstraintError) as err:
        hasten.generate(model, prompt, max_new_tokens=4, tokenizer=tokenizer, constraint=SPECS["choice"],
                        allowed_token_ids=[5, 6])
    assert err.value.field == "allowed_token_ids"
    with pytest.raises(ConstraintError) as err:  # the choice is complete after "no": EOS only, held back
        hasten.generate(model, prompt, max_new_tokens=8, tokenizer=tokenizer, constraint=Choice(["no"]), min_tokens=4)
    assert err.value.code == "no_allowed_token" and err.value.field == "min_tokens"
    with pytest.raises(ConstraintError, match="tokenizer="):
        hasten.generate(model, prompt, max_new_tokens=4, constraint=SPECS["choice"])



def test_ignore_eos_and_no_eos_are_refused(model, tokenizer, prompt):
    """A constrained row ends with EOS once its text is complete: without one it could not end."""
    from hasten.engine.batch import Request, Scheduler

    with pytest.raises(ConstraintError) as err:
        hasten.generate(model, prompt, max_new_tokens=4, tokenizer=tokenizer, constraint=SPECS["regex"],
                        eos_token_id=[])
    assert err.value.field == "eos_token_ids" and err.value.code == "conflicting_parameters"
    constraint = SPECS["regex"].compile(tokenizer, model.config.vocab_size)
    with pytest.raises(ConstraintError) as err:
        Scheduler(model).submit(Request(prompt[0].tolist(), 4, ignore_eos=True, constraint=constraint))
    assert err.value.field == "ignore_eos"


def test_forced_text_is_tokenized_as_the_tokenizer_writes_it(model, tokenizer):
    """The forced draft at the start is the tokenizer's own tokenization of the forced text; inside
    a string value nothing is forced; once the value closes, the draft continues across the boundary."""
    from hasten.drafters.base import EMPTY_DRAFT
    from hasten.engine.constraint import RowConstraint

    constraint = SPECS["json"].compile(tokenizer, model.config.vocab_size)
    start = RowConstraint(constraint, frozenset({EOS}), []).fit(EMPTY_DRAFT, 16, [], trees_ok=True)
    assert start.tokens and tokenizer.encode(tokenizer.decode(start.tokens)) == list(start.tokens)
    assert tokenizer.decode(start.tokens) == '{"name": "'
    written = tokenizer.encode('{"name": "ada')
    inside = RowConstraint(constraint, frozenset({EOS}), written)
    assert len(inside.fit(EMPTY_DRAFT, 16, written, trees_ok=True)) == 0
    closed = written + tokenizer.encode('"')
    after = RowConstraint(constraint, frozenset({EOS}), closed).fit(EMPTY_DRAFT, 16, closed, trees_ok=True)
    assert tokenizer.decode(after.tokens).startswith(', "age": ')


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("json-model")
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_engine_and_batch_take_a_constraint(checkpoint, references):
    engine = hasten.load(checkpoint, "prompt_lookup", draft_size="fixed")
    assert engine.generate(PROMPT_TEXT, max_new_tokens=NEW, constraint=hasten.JsonSchema(SCHEMA)).token_ids \
        == references["json"]
    rows = engine.generate_batch([PROMPT_TEXT, PROMPT_TEXT], max_new_tokens=NEW, constraint=SPECS["regex"])
    assert [row.token_ids for row in rows] == [references["regex"]] * 2
    streamed = "".join(engine.stream(PROMPT_TEXT, max_new_tokens=NEW, constraint=SPECS["choice"]))
    assert streamed == engine.tokenizer.decode(references["choice"], skip_special_tokens=True)


def test_the_command_line_flags(checkpoint, tmp_path, cli, references, tokenizer):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "yes.lark"
    grammar.write_text('start: "yes" | "no"')
    for flags, name in ((["--json-schema", str(schema)], "json"), (["--regex", SPECS["regex"].pattern], "regex"),
                        (["--choice", "maybe,yes,no"], "choice")):
        code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT_TEXT, "--max-new-tokens", str(NEW),
                             "--draft-size", "fixed", "--json", *flags)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == references[name]
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT_TEXT, "--max-new-tokens", "12",
                         "--grammar", str(grammar))
    assert code == 0 and out.strip() in ("yes", "no") and "forced" in err
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT_TEXT, "--json-object",
                         "--max-new-tokens", "8", "--json")
    assert code == 0 and json.loads(out)["text"].startswith("{")
    code, out, err = cli("generate", "--model", checkpoint, "--prompt", PROMPT_TEXT, "--regex", "(unclosed")
    assert code != 0 and "--regex" in err and "does not compile" in err


def test_processed_logprobs_report_the_masked_law(model, tokenizer, prompt, references):
    """Processed log-probabilities are read after the mask: the first token's alternatives are the
    tokens that can start one of the choices, and their probabilities sum to one."""
    from hasten.engine.batch import Request, Scheduler
    from hasten.core.sampling import Sampling

    constraint = SPECS["choice"].compile(tokenizer, model.config.vocab_size)
    scheduler = Scheduler(model, PromptLookup(num_tokens=4), draft_size="fixed")
    row = scheduler.submit(Request(prompt[0].tolist(), NEW, Sampling(), eos_token_ids=frozenset({EOS}), logprobs=20,
                                   processed_logprobs=True, constraint=constraint))
    first = None
    while scheduler.has_work():
        for update in scheduler.step():
            if update.row_id == row and update.logprobs and first is None:
                first = update.logprobs[0]
    starts = {tokenizer.decode([t]) for t, logprob in first.top if logprob > float("-inf")}
    assert starts and all(any(option.startswith(s) for option in ("maybe", "yes", "no")) for s in starts)
    assert sum(math.exp(logprob) for _, logprob in first.top) == pytest.approx(1.0, abs=1e-4)
