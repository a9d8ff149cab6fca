"""What a newcomer reads first keeps its promises (issue 44): the README's first library example
runs the real model, toy models are called toys, docs/README.md indexes every page, the
library's one-thread default is explained where the library is, the same seed's text is said to
depend on the method (and does), and docs/scale-out.md's `vllm serve` line is vLLM's."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

import hasten
from hasten import zoo
from hasten.core.threads import DEFAULT_THREADS
from hasten.drafters import PromptLookup
from helpers import repetitive_prompt, tiny_model

ROOT = Path(__file__).resolve().parents[1]
README, DOCS = ROOT / "README.md", ROOT / "docs"
TOYS = sorted(zoo.MODELS)  # the bundled models, all trained here for tests and demos


def section(text: str, title: str) -> str:
    """A markdown section's text, from its heading to the next heading of its level or above."""
    level = title.split(" ")[0]
    start = text.index(f"\n{title}\n")
    end = re.search(rf"\n#{{1,{len(level)}}} ", text[start + 1:])
    return text[start:start + 1 + end.start()] if end else text[start:]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def chunks(text: str) -> list[str]:
    """Each line of a code block, and each prose paragraph: where a label must sit beside a name."""
    found, prose = [], []
    for part, in_code in ((p, i % 2 == 1) for i, p in enumerate(re.split(r"^```.*$", text, flags=re.M))):
        if in_code:
            found += [line for line in part.splitlines() if line.strip()]
        else:
            prose += [paragraph for paragraph in re.split(r"\n\s*\n", part) if paragraph.strip()]
    return found + prose


def test_the_readmes_first_library_example_runs_the_real_model():
    first = python_blocks(section(README.read_text(), "## Library"))[0]
    assert 'hasten.load("zoo:smollm2-135m"' in first and not any(f"zoo:{toy}" in first for toy in TOYS)


@pytest.mark.parametrize("page", ["README.md", "docs/README.md", "docs/serve.md"])
def test_toy_models_are_called_toys_wherever_a_newcomer_meets_them(page):
    unlabelled = [chunk for chunk in chunks((ROOT / page).read_text())
                  if re.search(rf"zoo:({'|'.join(map(re.escape, TOYS))})\b", chunk) and "toy" not in chunk]
    assert not unlabelled, f"{page}: a bundled toy model named without saying it is a toy: {unlabelled[0]!r}"


def test_the_docs_index_links_every_page_and_every_link_resolves():
    index = (DOCS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", index))
    pages = {path.name for path in DOCS.glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"
    assert all((DOCS / link).resolve().is_file() for link in linked), linked
    assert "(docs/README.md" in README.read_text()


def test_the_library_section_gives_the_thread_default_and_its_reason():
    library = " ".join(section(README.read_text(), "## Library").split())
    assert DEFAULT_THREADS == 1 and "compute on **one CPU thread** by default, as the command line does" in library
    assert "`threads=N`; `0` = all cores, `None` leaves torch's setting alone" in library
    assert "4-10x slower whenever anything else ran" in library


def test_the_same_seed_gives_other_text_with_another_method_as_the_readme_says():
    readme = " ".join(README.read_text().split())
    assert "The same seed gives other text with another method, or with plain decoding" in readme
    model, prompt = tiny_model("llama"), repetitive_prompt(16)

    def sample(drafter, seed):
        generator = torch.Generator().manual_seed(seed)
        return hasten.generate(model, prompt, drafter=drafter, max_new_tokens=24, temperature=1.0,
                               generator=generator, draft_size="fixed").sequences.tolist()

    assert sample(None, 3) == sample(None, 3)  # one method and one seed: one text
    assert sample(PromptLookup(num_tokens=4), 3) == sample(PromptLookup(num_tokens=4), 3)
    assert sample(PromptLookup(num_tokens=4), 3) != sample(None, 3)  # another method: other draws


def serve_line() -> str:
    text = (DOCS / "scale-out.md").read_text()
    command = re.search(r"^vllm serve .*?(?<!\\)$", text, re.S | re.M)[0]
    return command.replace("\\\n", " ")


def test_the_vllm_serve_line_names_a_hasten_proposer():
    args = shlex.split(serve_line())
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config["method"] == "custom_class" and set(config) == {"method", "model", "num_speculative_tokens"}
    module, _, name = config["model"].rpartition(".")
    assert module == "hasten.vllm" and isinstance(getattr(hasten.vllm, name), type)


VLLM_PARSE = """
import shlex, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
args = parser.parse_args(shlex.split(sys.argv[1])[1:])
args.model = args.model_tag or args.model
engine = AsyncEngineArgs.from_cli_args(args)
print(repr((args.model, engine.dtype, engine.speculative_config)))
"""


@pytest.mark.vllm
def test_vllms_own_parser_reads_the_vllm_serve_line():
    from hasten.bench.vllm_cpu import vllm_python

    python = vllm_python()
    if python is None:
        pytest.skip("vLLM's environment is not installed: make vllm")
    run = subprocess.run([str(python), "-P", "-c", VLLM_PARSE, serve_line()], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    model, dtype, speculative = eval(run.stdout.strip().splitlines()[-1])
    assert (model, dtype) == ("path/to/model", "float32")
    assert speculative == {"method": "custom_class", "model": "hasten.vllm.PromptLookup", "num_speculative_tokens": 10}


@pytest.mark.real
def test_the_readmes_first_library_example_runs(capsys):
    from hasten import loading

    try:
        loading.resolve_path("zoo:smollm2-135m")
    except ValueError as err:
        pytest.skip(f"zoo:smollm2-135m is not available ({err}); run `make real` first")
    exec(compile(python_blocks(section(README.read_text(), "## Library"))[0], str(README), "exec"), {})
    first, second, third, *rest = capsys.readouterr().out.splitlines()
    assert first == "The cat sat on the mat."
    method, tau = second.split()
    assert method == "mixed" and float(tau) >= 1.0  # the default, with SmolLM2's shipped EAGLE-3 weights
    assert third in ("stop", "length") and rest
