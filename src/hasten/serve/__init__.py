"""``hasten serve``: an OpenAI-compatible HTTP server over the continuous-batching scheduler,
with Prometheus metrics, and ``hasten serve-bench``, its load generator.

The HTTP layer, the metrics and the load generator need the optional extra
(``pip install 'hasten[serve]'``: Starlette, uvicorn, prometheus-client, openai), so nothing
here imports them at package import: ``hasten --help`` works without it.
"""
