"""``/metrics``' speculative-decoding series from an engine snapshot (the exposition only)."""

from prometheus_client.parser import text_string_to_metric_families

from folio.api.metrics import Metrics


def _serving():
    return {"prompt_tokens": 0, "generation_tokens": 0, "request_success": {},
            "histograms": {n: {"bounds": [1.0], "counts": [0, 0], "sum": 0.0}
                           for n in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                                     "e2e_request_latency_seconds", "request_queue_time_seconds",
                                     "iteration_tokens_total")}}


def _samples(snapshot):
    text = Metrics("m").render(snapshot).decode()
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_spec_decode_counters_rates_and_positions():
    snap = {"num_total_blocks": 4, "num_free_blocks": 4, "serving": _serving(),
            "spec_decode_num_drafts": 8, "spec_decode_num_draft_tokens": 24, "spec_decode_num_accepted_tokens": 18,
            "spec_decode_num_accepted_tokens_per_pos": [8, 6, 4], "spec_decode_acceptance_rate": 0.75,
            "spec_decode_mean_acceptance_length": 3.25}
    s = _samples(snap)
    assert s[("folio:spec_decode_num_drafts_total", ())] == 8
    assert s[("folio:spec_decode_num_draft_tokens_total", ())] == 24
    assert s[("folio:spec_decode_num_accepted_tokens_total", ())] == 18
    assert [s[("folio:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))]
            for i in range(3)] == [8, 6, 4]
    assert s[("folio:spec_decode_acceptance_rate", ())] == 0.75
    assert s[("folio:spec_decode_mean_acceptance_length", ())] == 3.25


def test_without_speculation_the_counters_are_zero():
    s = _samples({"num_total_blocks": 4, "num_free_blocks": 4, "serving": _serving()})
    assert s[("folio:spec_decode_num_drafts_total", ())] == 0
    assert s[("folio:spec_decode_mean_acceptance_length", ())] == 1.0
    assert not any(k[0].startswith("folio:spec_decode_num_accepted_tokens_per_pos") for k in s)
