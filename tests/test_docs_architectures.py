"""The supported-architectures table in docs/README.md is what the tests cover: it is written from
the models the suites below build (their transformers ``model_type``), and this test fails when
the two disagree. ``python tests/test_docs_architectures.py`` rewrites the table."""
from __future__ import annotations

import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "README.md"
BEGIN = "<!-- architectures: written by tests/test_docs_architectures.py from what the tests build -->"
END = "<!-- end of architectures -->"

# column -> (what the suites check, the suites)
COLUMNS = {
    "greedy": ("greedy output equal to Hugging Face `generate`'s token for token, with no drafter, with the "
               "training-free drafters and with scripted chains and trees", "test_greedy_equality, test_gemma3, "
               "test_vlm, test_vlm_families"),
    "batched": ("continuous batching: each row exactly as it decodes alone", "test_batch"),
    "images": ("image prompts: the image prefill, then the same lossless text decoding", "test_vlm, test_vlm_families"),
    "dlm": ("used bidirectionally as a diffusion LM (`hasten.dlm`), SparseD's attention at full selection equal "
            "to full attention", "test_dlm"),
}


def suites() -> dict[str, list]:
    """Each column's models, built as its suites build them (imports of the test modules)."""
    import test_batch
    import test_dlm
    import test_gemma3
    import test_greedy_equality
    import test_vlm
    import test_vlm_families
    from helpers import tiny_model

    vlms = [make for make, *_ in test_vlm.FAMILIES.values()] + [make for make, _ in test_vlm_families.FAMILIES.values()]
    return {
        "greedy": [tiny_model(arch) for arch in test_greedy_equality.ARCHS] + [test_gemma3.tiny_gemma3()]
                  + [make() for make in vlms],
        "batched": [tiny_model(arch) for arch in test_batch.ARCHS],
        "images": [make() for make in vlms],
        "dlm": [test_dlm.causal_model(arch) for arch in test_dlm.SPARSED_ARCHS],
    }


def kind(model) -> str:
    if getattr(model.config, "vision_config", None) is not None:
        return "vision-language"
    return "encoder-decoder (drafts verified as chains)" if model.config.is_encoder_decoder else "causal LM"


def table() -> str:
    rows: dict[str, dict] = {}
    for column, models in suites().items():
        for model in models:
            row = rows.setdefault(model.config.model_type, {"kind": kind(model), "columns": set()})
            row["columns"].add(column)
    lines = ["| `model_type` | kind | " + " | ".join(column for column in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for model_type, row in sorted(rows.items()):
        marks = " | ".join("yes" if column in row["columns"] else "" for column in COLUMNS)
        lines.append(f"| `{model_type}` | {row['kind']} | {marks} |")
    lines += ["", "Columns, and the tests (in `tests/`) that build these models:", ""]
    lines += [f"- **{column}**: {what} ({tests})" for column, (what, tests) in COLUMNS.items()]
    return "\n".join(lines)


def written() -> str:
    """The page's table, as the lines between the markers."""
    found = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), PAGE.read_text(), re.S)
    assert found, f"{PAGE} has no architectures table between {BEGIN!r} and {END!r}"
    return found[1]


def test_the_architectures_table_is_what_the_tests_cover():
    assert written() == table() + "\n", "the tests cover other architectures: python tests/test_docs_architectures.py"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    text = PAGE.read_text()
    PAGE.write_text(text.replace(f"{BEGIN}\n{written()}{END}", f"{BEGIN}\n{table()}\n{END}"))
    print(f"wrote the architectures table of {PAGE}")
