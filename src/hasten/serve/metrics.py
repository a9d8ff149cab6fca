"""What ``GET /metrics`` reports, in Prometheus' text format (``prometheus-client``).

Each server has its own registry, so two apps in one process (tests) never share counters.
Acceptance per draft position is two counters, drafted and accepted, labelled by position:
their ratio over any time window is the acceptance rate, which a gauge could not give.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core.stats import DecodeStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TAU = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("hasten_requests", "HTTP requests answered, by route and status code",
                                ["route", "code"], registry=r)
        self.prompt_tokens = Counter("hasten_prompt_tokens", "prompt tokens of the requests taken", registry=r)
        self.generated_tokens = Counter("hasten_generated_tokens", "tokens generated", registry=r)
        self.finished = Counter("hasten_rows_finished", "generations ended, by reason (stop, length, cancelled, error)",
                                ["reason"], registry=r)
        self.steps = Counter("hasten_steps", "scheduler steps (one target forward each over the running batch)",
                             registry=r)
        self.running = Gauge("hasten_running_rows", "rows in the running batch", registry=r)
        self.waiting = Gauge("hasten_waiting_rows", "requests queued for admission", registry=r)
        self.batch_size = Histogram("hasten_step_batch_size", "rows decoded together in a step", buckets=BATCH,
                                    registry=r)
        self.step_seconds = Histogram("hasten_step_seconds", "seconds a step took (prefills of joining rows included)",
                                      buckets=SECONDS, registry=r)
        self.draft_seconds = Histogram("hasten_step_draft_seconds", "seconds a step spent drafting", buckets=SECONDS,
                                       registry=r)
        self.verify_seconds = Histogram("hasten_step_verify_seconds", "seconds a step spent verifying",
                                        buckets=SECONDS, registry=r)
        self.queue_seconds = Histogram("hasten_queue_seconds", "seconds from submission to admission",
                                       buckets=SECONDS, registry=r)
        self.tau = Histogram("hasten_tau", "tokens per target forward of each finished generation (tau)",
                             buckets=TAU, registry=r)
        self.drafted = Counter("hasten_drafted_at_position", "steps that drafted draft position P (1-based)",
                               ["position"], registry=r)
        self.accepted = Counter("hasten_accepted_at_position", "steps whose accepted path reached draft position P",
                                ["position"], registry=r)
        self.drafted_tokens = Counter("hasten_drafted_tokens", "draft tokens proposed and verified", registry=r)
        self.accepted_tokens = Counter("hasten_accepted_tokens", "draft tokens accepted (bonus tokens not counted)",
                                       registry=r)
        self.speculating = Counter("hasten_rows_speculating", "finished generations by whether they drafted "
                                   "(false: plain decoding, asked for with speculate=false or a method without drafts)",
                                   ["speculated"], registry=r)
        self.kv_bytes = Gauge("hasten_kv_cache_bytes", "bytes the running batch's KV cache holds allocated",
                              registry=r)
        self.reused_tokens = Counter("hasten_prefix_cached_tokens", "prompt tokens whose KV entries a finished "
                                     "request left (the prefix cache), copied instead of prefilled", registry=r)
        # what a client waits for, as vLLM reports it: the first token, each next token, the whole answer
        self.first_token_seconds = Histogram("hasten_time_to_first_token_seconds",
                                             "seconds from a request's submission to its first generated token",
                                             buckets=SECONDS, registry=r)
        self.inter_token_seconds = Histogram("hasten_inter_token_seconds",
                                             "seconds between a request's generated tokens (tokens that arrive "
                                             "together share the wait before them)", buckets=SECONDS, registry=r)
        self.request_seconds = Histogram("hasten_request_seconds",
                                         "seconds from a request's submission to its last token", buckets=SECONDS,
                                         registry=r)

    def tokens_arrived(self, count: int, since_submission: float, since_last: float | None) -> None:
        """``count`` tokens of one request arrived together, ``since_last`` seconds after its
        previous ones (None: these are its first). The first token's wait is the time to first
        token; every other token gets an equal share of the wait before its group (the first
        group's others: none), so the mean inter-token time is (end - first) / (tokens - 1)."""
        if count <= 0:
            return
        if since_last is None:
            self.first_token_seconds.observe(since_submission)
            count, since_last = count - 1, 0.0
        for _ in range(count):
            self.inter_token_seconds.observe(since_last / count)

    def step(self, info, running: int, waiting: int) -> None:
        """One scheduler step, from its ``StepInfo`` (batch_size, seconds, draft_seconds, verify_seconds)."""
        self.steps.inc()
        self.batch_size.observe(info.batch_size)
        self.step_seconds.observe(info.seconds)
        self.draft_seconds.observe(info.draft_seconds)
        self.verify_seconds.observe(info.verify_seconds)
        self.queue_depth(running, waiting)

    def queue_depth(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def row_finished(self, reason: str, stats: DecodeStats, queued_seconds: float, speculated: bool = False) -> None:
        """A generation ended: its tokens, its mean accepted length (tau), its drafted and
        accepted tokens, overall and per draft position."""
        self.finished.labels(reason).inc()
        self.generated_tokens.inc(stats.new_tokens)
        self.queue_seconds.observe(queued_seconds)
        self.speculating.labels("true" if speculated else "false").inc()
        self.drafted_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        if stats.steps:
            self.tau.observe(stats.mean_accepted)
        accepted = padded(stats.accepted_at_depth, len(stats.drafted_at_depth))
        for position, (drafted, hits) in enumerate(zip(stats.drafted_at_depth, accepted), start=1):
            self.drafted.labels(str(position)).inc(drafted)
            self.accepted.labels(str(position)).inc(hits)

    def watch_pool(self, pool) -> None:
        """Report the drafter's shared pool (a :class:`~hasten.core.pool.Pool`), read at each scrape."""
        self.registry.register(PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PoolCollector:
    """The shared pool's size and hit rate, read from the pool when ``/metrics`` is asked."""

    def __init__(self, pool):
        self.pool = pool

    def describe(self):
        return []  # read at each scrape: nothing to check at registration

    def collect(self):
        stats = self.pool.stats()
        unit = "nodes" if self.pool.kind == "lookahead" else "tokens"
        yield GaugeMetricFamily("hasten_pool_entries", f"what the shared draft pool holds ({self.pool.kind}: {unit}), "
                                "the quantity its memory bound counts", value=stats.entries)
        yield GaugeMetricFamily("hasten_pool_requests", "generations whose text the shared pool holds",
                                value=stats.requests)
        yield CounterMetricFamily("hasten_pool_lookups", "draft steps that asked the shared pool", value=stats.lookups)
        yield CounterMetricFamily("hasten_pool_hits", "draft steps whose draft came from text the pool learned "
                                  "(others' output or this request's own, not its prompt)", value=stats.hits)
        yield GaugeMetricFamily("hasten_pool_hit_rate", "hits / lookups since the server started",
                                value=stats.hit_rate)


def padded(values: list[int], length: int) -> list[int]:
    return values + [0] * (length - len(values))
