"""``hasten serve``: an OpenAI-compatible HTTP server over the continuous-batching scheduler,
with Prometheus metrics (its load generator, ``hasten serve-bench``, is a bench:
:mod:`hasten.bench.serve_load`).

The HTTP layer and the metrics need the optional extra (``pip install 'hasten[serve]'``:
Starlette, uvicorn, prometheus-client), so nothing here imports them at package import:
``hasten --help`` works without it.
"""
