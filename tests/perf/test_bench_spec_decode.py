"""``folio bench serve``'s speculative-decoding figures: the server's counters over the run."""

from perf.bench.serve import spec_decode_figures


def test_figures_are_the_counters_over_the_run():
    before = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30, "spec_decode_num_accepted_tokens": 20,
              "spec_decode_num_accepted_tokens_per_pos": [9, 7, 4]}
    after = {"spec_decode_num_drafts": 30, "spec_decode_num_draft_tokens": 90, "spec_decode_num_accepted_tokens": 50,
             "spec_decode_num_accepted_tokens_per_pos": [25, 17, 8]}
    f = spec_decode_figures(before, after)
    assert (f["drafts"], f["draft_tokens"], f["accepted_tokens"]) == (20, 60, 30)
    assert f["acceptance_rate"] == 0.5 and f["mean_acceptance_length"] == 2.5
    assert f["per_position_acceptance_rate"] == [16 / 20, 10 / 20, 4 / 20]
    assert spec_decode_figures({}, {"num_steps": 3}) is None   # a server without speculation
