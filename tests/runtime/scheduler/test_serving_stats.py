"""runtime/scheduler/metrics.py: histogram buckets (Prometheus' ``le`` semantics) and the per-request figures
derived from a hand-written sequence of engine deltas with known times."""

import pytest

from folio.runtime.scheduler.metrics import Histogram, ServingStats
from folio.runtime.common.outputs import CompletionDelta, RequestDelta, RequestMetrics


def test_histogram_buckets_are_less_or_equal():
    h = Histogram([1, 2, 4])
    for v in (0.5, 1, 1.5, 2, 4, 4.5, 100):
        h.observe(v)
    assert h.counts == [2, 2, 1, 2]          # (-inf, 1], (1, 2], (2, 4], (4, +inf)
    assert h.count == 7 and h.sum == pytest.approx(113.5)
    with pytest.raises(ValueError):
        Histogram([2, 1])


def delta(rid, n_new, finished=False, reason=None, arrival=100.0, first=None, sched=100.5, end=None, prompt=3):
    m = RequestMetrics(arrival, sched, first, end, end) if finished else None
    return RequestDelta(rid, [CompletionDelta(0, list(range(n_new)), "", finish_reason=reason)], finished, 0, None,
                        list(range(prompt)), m)


def test_serving_stats_from_deltas():
    s = ServingStats()
    s.on_step([], 7, now=100.6)                                           # a prefill step with no output yet
    s.on_step([delta("a", 1)], 8, now=101.0)
    s.on_step([delta("a", 1), delta("b", 1, prompt=5)], 2, now=101.25)   # ITL 0.25 for a
    s.on_step([delta("a", 1, finished=True, reason="length", first=101.0, end=101.75)], 2, now=101.75)  # ITL 0.5
    s.on_step([delta("b", 0, finished=True, reason="abort", arrival=101.0, sched=101.1, first=101.25, end=102.0,
                     prompt=5)], None, now=102.0)
    d = s.to_dict()
    h = d["histograms"]
    assert d["prompt_tokens"] == 3 + 5 and d["generation_tokens"] == 4
    assert d["request_success"] == {"length": 1, "abort": 1}
    assert h["time_to_first_token_seconds"]["sum"] == pytest.approx(1.0 + 0.25)       # from the engine's stamps
    assert sum(h["inter_token_latency_seconds"]["counts"]) == 2                       # a's 2nd and 3rd tokens
    assert h["inter_token_latency_seconds"]["sum"] == pytest.approx(0.25 + 0.5)
    assert h["e2e_request_latency_seconds"]["sum"] == pytest.approx(1.75 + 1.0)
    assert h["request_queue_time_seconds"]["sum"] == pytest.approx(0.5 + 0.1)
    assert sum(h["iteration_tokens_total"]["counts"]) == 4 and h["iteration_tokens_total"]["sum"] == 19
    assert s._last_token_time == {}                                                   # finished requests forgotten
