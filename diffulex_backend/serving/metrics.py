"""The served model's custom metrics, exported by Triton on its metrics port next to its own.

`metric_family` is `triton_python_backend_utils.MetricFamily` inside the server: a class built as
`MetricFamily(name=..., description=..., kind=MetricFamily.COUNTER)` whose `Metric(labels=..., buckets=...)`
gives a metric with `increment`, `set` and `observe`. Each update is a round trip to the server process, so the
decoding thread makes none while it steps: the response thread makes most, Triton's thread counts the requests it
ends at once (refused, unavailable while the model cannot serve, or failed inside `execute`), and the decoding
thread counts only when the response thread has stopped.

Updates hold one lock a model instance (`_LockedMetric`): in Triton 2.51's Python backend, an update from one
thread of the stub replaces the metric's message in shared memory while the server may still be reading the
message of another thread's update, and the server process dies (SIGSEGV in `Metric::LoadFromSharedMemory`).
Two threads counting one error cause at once crashed it (docs/reliability.md).

Each model instance (a stub process with an engine of its own) labels its series with the model, its version, the
instance's name and its engine's device, so that the instances of one model are separate series: sum them for
the model's totals.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .. import EngineMetrics

TIME_TO_FIRST_TOKEN_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
REQUEST_LATENCY_BUCKETS_S = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
# Committed tokens per forward pass a request took part in: 1 is autoregressive speed, more is the gain of
# parallel decoding.
TOKENS_PER_FORWARD_BUCKETS = [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0]
# Why a request ended with an error: refused as sent (INVALID_ARG), cancelled by its client, ended by an engine
# failure or by a thread of the model that stopped, refused while the model cannot serve (UNAVAILABLE), or a fault
# of ours that touched that request alone (INTERNAL).
ERROR_CAUSES = ("refused", "cancelled", "engine_failure", "thread_death", "unavailable", "internal")


class _LockedMetric:
    """A metric whose updates hold the lock that every metric of its ServingMetrics shares (the module docstring
    says why); anything else is the metric's own."""

    def __init__(self, metric, lock: threading.Lock):
        self._metric, self._lock = metric, lock

    def increment(self, value: float) -> None:
        with self._lock:
            self._metric.increment(value)

    def set(self, value: float) -> None:
        with self._lock:
            self._metric.set(value)

    def observe(self, value: float) -> None:
        with self._lock:
            self._metric.observe(value)

    def __getattr__(self, name: str):
        return getattr(self._metric, name)


class ServingMetrics:
    def __init__(self, metric_family, labels: dict[str, str], refusal_fields: tuple[str, ...] = (),
                 settings: dict[str, str] | None = None):
        """`refusal_fields`: the fields a refusal may name; any other name is counted as "other", so that a client
        cannot grow the label set. `settings`: the engine's resolved settings, published as an info metric (one
        series of value 1 per setting, labelled with its name and value), since Triton's model configuration
        endpoint can only show config.pbtxt as written."""
        lock = threading.Lock()
        locked = lambda series: _LockedMetric(series, lock)  # noqa: E731

        def metric(name, description, kind, buckets=None):
            family = metric_family(name=name, description=description, kind=kind)
            self._families.append(family)  # a family unregisters when it is garbage collected
            return locked(family.Metric(labels=labels) if buckets is None else
                          family.Metric(labels=labels, buckets=buckets))

        self._families = []
        self._gauge_values: dict[int, float] = {}  # id(gauge) -> the value last set
        counter, gauge, histogram = metric_family.COUNTER, metric_family.GAUGE, metric_family.HISTOGRAM
        self.prompt_tokens = metric("diffulex_prompt_tokens_total", "Prompt tokens of served requests", counter)
        self.generation_tokens = metric("diffulex_generation_tokens_total", "Generated tokens sent", counter)
        self.time_to_first_token = metric(
            "diffulex_time_to_first_token_seconds", "From arrival to the first committed token", histogram,
            TIME_TO_FIRST_TOKEN_BUCKETS_S)
        self.request_latency = metric(
            "diffulex_e2e_request_latency_seconds", "From arrival to the last response", histogram,
            REQUEST_LATENCY_BUCKETS_S)
        self.tokens_per_forward = metric(
            "diffulex_tokens_per_forward", "Output tokens per forward pass, per finished request", histogram,
            TOKENS_PER_FORWARD_BUCKETS)
        self.running = metric("diffulex_num_requests_running", "Requests in the running batch", gauge)
        self.waiting = metric("diffulex_num_requests_waiting", "Requests waiting to be scheduled", gauge)
        self.preempted = metric("diffulex_num_requests_preempted", "Requests preempted, waiting to resume", gauge)
        self.kv_pages_used = metric("diffulex_kv_pages_used", "KV cache pages held by requests", gauge)
        self.kv_pages_free = metric("diffulex_kv_pages_free", "KV cache pages free for new requests", gauge)
        self.prefix_cache_hit_ratio = metric(
            "diffulex_prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache / prompt tokens looked up",
            gauge)
        self.prefix_cache_hits = metric("diffulex_prefix_cache_hit_tokens_total",
                                        "Prompt tokens found in the prefix cache", counter)
        self.prefix_cache_queries = metric("diffulex_prefix_cache_queried_tokens_total",
                                           "Prompt tokens looked up in the prefix cache", counter)
        self._prefix_counted = (0, 0)  # the engine's (hit, queried) tokens already added to the counters

        errors = metric_family(name="diffulex_request_errors_total",
                               description="Requests that ended with an error, by cause", kind=counter)
        refusals = metric_family(name="diffulex_request_refusals_total",
                                 description="Requests refused as sent, by the field the refusal names", kind=counter)
        info = metric_family(name="diffulex_engine_setting_info",
                             description="The engine's settings as resolved at load, one series per setting", kind=gauge)
        self._families += [errors, refusals, info]
        self._settings = [locked(info.Metric(labels={**labels, "setting": name, "value": value}))
                          for name, value in (settings or {}).items()]
        for series in self._settings:
            series.set(1)
        self._errors = {cause: locked(errors.Metric(labels={**labels, "cause": cause})) for cause in ERROR_CAUSES}
        self._refusals = {field: locked(refusals.Metric(labels={**labels, "field": field}))
                          for field in (*refusal_fields, "other")}

    def count_errors(self, cause: str, count: int = 1) -> None:
        if count:
            self._errors[cause].increment(count)

    def count_refusal(self, field: str) -> None:
        self._errors["refused"].increment(1)
        self._refusals[field if field in self._refusals else "other"].increment(1)

    def update_engine(self, snapshot: EngineMetrics) -> None:
        """Set the gauges that changed since the last snapshot: each set is a round trip to the server, and most
        steps change none of them."""
        queried = snapshot.prefix_cache_queried_tokens
        values = {
            self.running: snapshot.num_running,
            self.waiting: snapshot.num_waiting,
            self.preempted: snapshot.num_preempted,
            self.kv_pages_used: snapshot.kv_pages_used,
            self.kv_pages_free: snapshot.kv_pages_free,
            self.prefix_cache_hit_ratio: snapshot.prefix_cache_hit_tokens / queried if queried else 0.0,
        }
        for gauge, value in values.items():
            if self._gauge_values.get(id(gauge)) != value:
                gauge.set(value)
                self._gauge_values[id(gauge)] = value
        hits, counted_hits = snapshot.prefix_cache_hit_tokens, self._prefix_counted[0]
        if queried > self._prefix_counted[1]:
            self.prefix_cache_queries.increment(queried - self._prefix_counted[1])
            if hits > counted_hits:
                self.prefix_cache_hits.increment(hits - counted_hits)
            self._prefix_counted = (hits, queried)
