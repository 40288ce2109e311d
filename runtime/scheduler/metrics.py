"""Serving statistics: per-step and per-request figures, kept as plain counters and fixed-bucket
histograms so that another process can export them (``folio serve``'s HTTP process turns them into
Prometheus metrics named as vLLM names them, under a ``folio:`` prefix).

What is measured follows vLLM V1's ``IterationStats`` / ``FinishedRequestStats``
(``vllm/v1/metrics/stats.py``) and the metric definitions of ``vllm/v1/metrics/loggers.py``:

- time_to_first_token_seconds: first output token's time minus the request's arrival;
- inter_token_latency_seconds: time between successive output tokens of a request (one sample per
  step in which the request got a token, after its first);
- e2e_request_latency_seconds: finish minus arrival;
- request_queue_time_seconds: first scheduled minus arrival (time spent waiting);
- iteration_tokens_total: tokens computed per engine step (decode tokens + prefill chunks);
- counters: prompt_tokens (each request's prompt length, counted at its first token),
  generation_tokens, request_success by finished_reason ("stop", "length", "abort").

Times are wall-clock seconds: the engine's stamps (``RequestMetrics``) where a request's last delta
carries them, the time a step's deltas were handed out for inter-token latency. Pure Python, no I/O.
"""

from __future__ import annotations

import bisect
import time
from typing import Iterable

# bucket upper bounds (seconds / tokens); an implicit +Inf bucket follows, as in Prometheus
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Histogram:
    """Counts of observations per bucket (``le`` upper bounds, cumulative on export) and their sum.

    Args:
        bounds: increasing finite upper bounds; one more bucket (+Inf) holds the rest.
    """

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(float(b) for b in bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("histogram bounds must be strictly increasing")
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # a value equal to a bound belongs to that bucket (Prometheus' le = "less or equal")
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def to_dict(self) -> dict:
        """``{"bounds": [...], "counts": [...] (per bucket, not cumulative; last = +Inf), "sum": float}``."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class ServingStats:
    """Accumulates the figures above from the ``RequestDelta``s of each engine step.

    Call ``on_step(deltas, num_scheduled_tokens)`` once per step with every delta of that step
    (aborted requests included); ``to_dict()`` gives the counters and histograms. Inter-token
    latency is timed here, at the step that delivered the tokens; TTFT, end-to-end latency and
    queue time come from the engine's own stamps (``RequestMetrics``) on a request's last delta.
    """

    def __init__(self):
        self.histograms = {
            "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
            "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
            "e2e_request_latency_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "request_queue_time_seconds": Histogram(REQUEST_TIME_BUCKETS),
            "iteration_tokens_total": Histogram(ITERATION_TOKEN_BUCKETS),
        }
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: dict[str, int] = {}
        self._last_token_time: dict[str, float] = {}   # request id -> when its latest tokens came out

    def on_step(self, deltas, num_scheduled_tokens: int | None, now: float | None = None) -> None:
        """Record one engine step: its token count (``None``/0 when nothing ran) and its deltas,
        delivered at ``now`` (seconds, ``time.time()``; default: the current time)."""
        if num_scheduled_tokens:
            self.histograms["iteration_tokens_total"].observe(num_scheduled_tokens)
        if now is None:
            now = time.time()
        h = self.histograms
        for d in deltas:
            rid = d.request_id
            n_new = sum(len(c.token_ids) for c in d.outputs)
            if n_new:
                self.generation_tokens += n_new
                last = self._last_token_time.get(rid)
                if last is None:
                    self.prompt_tokens += len(d.prompt_token_ids)
                else:
                    h["inter_token_latency_seconds"].observe(max(0.0, now - last))
                self._last_token_time[rid] = now
            if d.finished:
                self._last_token_time.pop(rid, None)
                reason = next((c.finish_reason for c in d.outputs if c.finish_reason), None) or "abort"
                self.request_success[reason] = self.request_success.get(reason, 0) + 1
                m = d.metrics
                if m is not None:
                    if m.first_token_time is not None:
                        h["time_to_first_token_seconds"].observe(max(0.0, m.first_token_time - m.arrival_time))
                    if m.finished_time is not None:
                        h["e2e_request_latency_seconds"].observe(max(0.0, m.finished_time - m.arrival_time))
                    if m.first_scheduled_time is not None:
                        h["request_queue_time_seconds"].observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
                "request_success": dict(self.request_success),
                "histograms": {k: h.to_dict() for k, h in self.histograms.items()}}
