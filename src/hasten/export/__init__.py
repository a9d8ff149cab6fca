"""``hasten export``: a drafter hasten trained, in the layout another engine loads (docs/scale-out.md).

Each pair of a drafter and a format that hasten can express exactly has one writer
(:data:`WRITERS`). Everything a writer makes passes a strict check of the engine's layout
(:func:`~.layout.check`: the exact tensor names, shapes and floating dtypes the engine's module
declares) before a file is written: vLLM's and SGLang's loaders skip names they do not know
without an error, which a user only sees as drafts that are never accepted. A pair hasten cannot
express is refused with what is missing (:data:`REFUSALS`).
"""
from .export import FORMATS, REFUSALS, WRITERS, Exported, eagle3_for, export, medusa_for_vllm, write
from .layout import ExportError

__all__ = ["FORMATS", "REFUSALS", "WRITERS", "ExportError", "Exported", "eagle3_for", "export", "medusa_for_vllm", "write"]
