"""``GET /metrics``: the scheduler's counters in Prometheus' text format (``prometheus_client``).

Names are vLLM's (``vllm/v1/metrics/loggers.py``) under a ``folio:`` prefix, each labelled with
``model_name``. Every scrape asks the scheduler process for a fresh snapshot
(``AsyncClient.get_metrics``: engine gauges and counters, plus ``runtime.metrics.ServingStats``'
histograms) and exposes it through a custom collector, so the numbers count every request the
engine ran, whichever door (HTTP or ZeroMQ) it came through.

Differences from vLLM: ``num_requests_running`` / ``num_requests_waiting`` count sequences (a request
with ``n`` samples counts ``n`` once forked); ``prefix_cache_queries`` / ``prefix_cache_hits`` count
tokens, as vLLM's do. The ``spec_decode_*`` counters are vLLM's (zero without
``--speculative-config``); ``spec_decode_acceptance_rate`` and ``spec_decode_mean_acceptance_length``
are gauges of what they give since start (vLLM's logger prints them; here they can be scraped).

Data-parallel replicas (``folio serve --data-parallel-size N``): every series is given per replica
with the label ``engine="i"`` (vLLM's label for its data-parallel ranks) and once more for the
sum over the replicas with ``engine="total"`` (so sum over ``engine!="total"``, or select
``engine="total"``). A replica that is down has no per-replica series until it is back.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "folio:"

_GAUGES = [
    ("num_requests_running", "Number of sequences in the running batch.",
     lambda m: m.get("num_running", 0)),
    ("num_requests_waiting", "Number of sequences waiting to be scheduled.",
     lambda m: m.get("num_waiting", 0)),
    ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
     lambda m: 1.0 - m["num_free_blocks"] / m["num_total_blocks"] if m.get("num_total_blocks") else 0.0),
    ("spec_decode_acceptance_rate", "Accepted / proposed draft tokens since start (0 before any).",
     lambda m: m.get("spec_decode_acceptance_rate", 0.0)),
    ("spec_decode_mean_acceptance_length", "Tokens per speculative step since start: 1 + accepted / steps.",
     lambda m: m.get("spec_decode_mean_acceptance_length", 1.0)),
]
_COUNTERS = [
    ("prompt_tokens", "Number of prompt tokens of requests that produced a first token.",
     lambda m: m["serving"]["prompt_tokens"]),
    ("generation_tokens", "Number of generated tokens.", lambda m: m["serving"]["generation_tokens"]),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
     lambda m: m.get("prefix_cache_queries", 0)),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", lambda m: m.get("prefix_cache_hits", 0)),
    ("num_preemptions", "Number of preemptions (recompute) in the engine.", lambda m: m.get("num_preemptions", 0)),
    ("spec_decode_num_drafts", "Speculative steps: sequences that verified proposed tokens, counted per step.",
     lambda m: m.get("spec_decode_num_drafts", 0)),
    ("spec_decode_num_draft_tokens", "Proposed (draft) tokens verified.", lambda m: m.get("spec_decode_num_draft_tokens", 0)),
    ("spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.",
     lambda m: m.get("spec_decode_num_accepted_tokens", 0)),
]
_HISTOGRAMS = [
    ("time_to_first_token_seconds", "Time to first token, from arrival at the engine."),
    ("inter_token_latency_seconds", "Time between successive tokens of a request."),
    ("e2e_request_latency_seconds", "End-to-end request latency, from arrival to finish."),
    ("request_queue_time_seconds", "Time a request waited before it was first scheduled."),
    ("iteration_tokens_total", "Tokens computed per engine step."),
]
FINISHED_REASONS = ("stop", "length", "abort")
METRIC_NAMES = [n for n, _, _ in _GAUGES] + [n for n, _, _ in _COUNTERS] + ["request_success"] + \
               [n for n, _ in _HISTOGRAMS]   # (spec_decode_num_accepted_tokens_per_pos: only with drafts)


class SnapshotCollector:
    """Exposes the latest scheduler snapshot (``set(snapshot)`` before each ``generate_latest``)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict | None = None

    def set(self, snapshot: dict) -> None:
        self.snapshot = snapshot

    def collect(self):
        m = self.snapshot
        if not m:
            return
        # data-parallel replicas (folio serve --data-parallel-size N): one series per replica,
        # labelled engine="i" as vLLM labels its data-parallel ranks, and the totals as engine="total"
        reps = m.get("replicas")
        if reps is None:
            series = [(["model_name"], [self.model_name], m)]
        else:
            series = [(["model_name", "engine"], [self.model_name, str(r["engine"])], r)
                      for r in reps if r.get("serving")]
            series.append((["model_name", "engine"], [self.model_name, "total"], m))
        series = [s for s in series if s[2].get("serving")]
        if not series:
            return
        labels = series[0][0]
        for name, doc, get in _GAUGES:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for _, values, snap in series:
                g.add_metric(values, float(get(snap)))
            yield g
        for name, doc, get in _COUNTERS:
            c = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for _, values, snap in series:
                c.add_metric(values, float(get(snap)))
            yield c
        c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                "Accepted draft tokens by their position in the proposal.",
                                labels=labels + ["position"])
        for _, values, snap in series:
            for pos, n in enumerate(snap.get("spec_decode_num_accepted_tokens_per_pos") or []):
                c.add_metric(values + [str(pos)], float(n))
        yield c
        c = CounterMetricFamily(PREFIX + "request_success", "Finished requests by finish reason.",
                                labels=labels + ["finished_reason"])
        for _, values, snap in series:
            serving = snap["serving"]
            for reason in sorted(set(FINISHED_REASONS) | set(serving["request_success"])):
                c.add_metric(values + [reason], float(serving["request_success"].get(reason, 0)))
        yield c
        for name, doc in _HISTOGRAMS:
            fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
            for _, values, snap in series:
                h = snap["serving"]["histograms"][name]
                buckets, total = [], 0
                for bound, count in zip(h["bounds"] + [float("inf")], h["counts"]):
                    total += count
                    buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
                fam.add_metric(values, buckets, sum_value=h["sum"])
            yield fam


class Metrics:
    """A registry holding the snapshot collector; ``render(snapshot)`` -> exposition bytes."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector(model_name)
        self.registry.register(self.collector)

    def render(self, snapshot: dict) -> bytes:
        self.collector.set(snapshot)
        return generate_latest(self.registry)
