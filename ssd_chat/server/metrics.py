"""``GET /metrics``: Prometheus counters over every reply the server decoded.

Names follow vLLM where vLLM has the figure, so dashboards and PromQL written for vLLM work:
``vllm:spec_decode_num_drafts_total`` (verifications), ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}``, the token
and request counters, queue gauges and latency histograms.  Acceptance rate and mean accepted
length are PromQL over those counters (as in vLLM's docs)::

    rate(vllm:spec_decode_num_accepted_tokens_total[1m]) / rate(vllm:spec_decode_num_draft_tokens_total[1m])
    1 + rate(vllm:spec_decode_num_accepted_tokens_total[1m]) / rate(vllm:spec_decode_num_drafts_total[1m])

SSD's own figure, the speculation cache, has no vLLM name: ``ssd_chat:ssd_cache_hits_total`` over
``ssd_chat:ssd_cache_lookups_total`` is the cache-hit rate.  One registry per server (not
prometheus_client's global one), so several servers in one process do not collide.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811 - re-exported
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ..engine import Done, Error, Event, Round, Stats

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no *_created series beside each counter: they only repeat the start time
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self._label = {"model_name": model_name}
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Verifications by the target (speculative rounds).", m, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", m, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, registry=r)
        self.accepted_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens per draft position.",
                                    m + ["position"], registry=r)
        self.cache_lookups = Counter("ssd_chat:ssd_cache_lookups", "SSD rounds that looked up the speculation cache.", m, registry=r)
        self.cache_hits = Counter("ssd_chat:ssd_cache_hits", "SSD rounds whose outcome was in the speculation cache.", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m, registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests by reason (stop, length, abort, error).",
                                m + ["finished_reason"], registry=r)
        self.rejected = Counter("ssd_chat:requests_rejected", "Requests refused because the queue was full (429).", m, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests decoding now (0 or 1: batch 1).", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued behind the running one.", m, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, from the start of decoding.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time waiting in the queue.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.tok_per_s = Gauge("ssd_chat:last_decode_tokens_per_second", "Decode rate of the last finished reply.", m, registry=r)

    def _l(self, metric):  # the child for this server's model
        return metric.labels(**self._label)

    def observe(self, ev: Event) -> None:
        """Count one event of the reply being decoded (called on the engine thread)."""
        if isinstance(ev, Round):
            self._l(self.drafts).inc()
            self._l(self.draft_tokens).inc(len(ev.drafted))
            self._l(self.accepted).inc(ev.accepted)
            for pos in range(len(ev.drafted)):  # every drafted position gets a series, 0 until one is accepted
                self.accepted_pos.labels(position=str(pos), **self._label).inc(1 if pos < ev.accepted else 0)
            if ev.cache_hit is not None:
                self._l(self.cache_lookups).inc()
                if ev.cache_hit:
                    self._l(self.cache_hits).inc()
        elif isinstance(ev, Done):
            self._finished("abort" if ev.reason == "cancelled" else "length" if ev.reason == "length" else "stop", ev.stats)
        elif isinstance(ev, Error):
            self._finished("error", None)

    def _finished(self, reason: str, stats: Stats | None) -> None:
        self.requests.labels(finished_reason=reason, **self._label).inc()
        if stats is not None:
            self._l(self.generation_tokens).inc(stats.new_tokens)
            if stats.ttft_s is not None:
                self._l(self.ttft).observe(stats.ttft_s)
            if stats.tok_per_s is not None:
                self._l(self.tok_per_s).set(stats.tok_per_s)

    def started(self, num_prompt: int, queued_s: float) -> None:
        self._l(self.prompt_tokens).inc(num_prompt)
        self._l(self.queue_time).observe(queued_s)

    def ended(self, since_arrival_s: float) -> None:
        self._l(self.e2e).observe(since_arrival_s)

    def follow(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """The queue gauges, read from the worker at each scrape."""
        self._l(self.running).set_function(running)
        self._l(self.waiting).set_function(waiting)

    def render(self) -> bytes:
        return generate_latest(self.registry)
