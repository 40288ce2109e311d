"""Speculative decoding's fields on the worker wire and in merged replica metrics (no model)."""

import numpy as np

from folio.ipc import messages as M
from folio.ipc.data_parallel import merge_metrics
from folio.runtime.common.step import StepPlan, StepResult


def _plan(num_draft):
    T, S = 9, 2
    return StepPlan(step_id=3, input_ids=np.arange(T, dtype=np.int64), positions=np.arange(T, dtype=np.int64),
                    slot_mapping=np.arange(T, dtype=np.int64), query_start_loc=np.array([0, 5, 9], np.int32),
                    seq_lens=np.array([5, 4], np.int32), block_tables=np.zeros((S, 1), np.int32),
                    seq_ids=np.arange(S, dtype=np.int64), logits_indices=np.array([4, 8], np.int64),
                    sample_seq_ids=np.arange(S, dtype=np.int64), num_draft_tokens=num_draft)


def test_plan_carries_its_draft_counts_only_when_it_has_drafts():
    got = M.plan_from_fields(M.decode(M.encode_plan(_plan(np.array([3, 0], np.int64))))[1])
    assert got.num_draft_tokens.tolist() == [3, 0]
    plain = _plan(np.zeros(0, np.int64))
    frames = M.encode_plan(plain)
    assert len(M.plan_from_fields(M.decode(frames)[1]).num_draft_tokens) == 0
    assert len(frames) == len(M.encode_plan(_plan(np.array([3, 0], np.int64)))) - 1


def test_result_carries_accepted_counts():
    r = StepResult(3, np.array([5, 6], np.int64), num_accepted_tokens=np.array([2, 0], np.int64))
    g = M.result_from_fields(M.decode(M.encode_result(r))[1])
    assert g.num_accepted_tokens.tolist() == [2, 0]
    assert M.result_from_fields(M.decode(M.encode_result(StepResult(4, np.zeros(1, np.int64))))[1]) \
        .num_accepted_tokens is None


def test_merged_replicas_recompute_the_rates_from_the_summed_counters():
    a = {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 30, "spec_decode_num_accepted_tokens": 30,
         "spec_decode_num_accepted_tokens_per_pos": [10, 10, 10], "spec_decode_acceptance_rate": 1.0,
         "spec_decode_mean_acceptance_length": 4.0}
    b = {"spec_decode_num_drafts": 30, "spec_decode_num_draft_tokens": 90, "spec_decode_num_accepted_tokens": 0,
         "spec_decode_num_accepted_tokens_per_pos": [0, 0, 0], "spec_decode_acceptance_rate": 0.0,
         "spec_decode_mean_acceptance_length": 1.0}
    m = merge_metrics([a, b])
    assert m["spec_decode_num_accepted_tokens_per_pos"] == [10, 10, 10]
    assert m["spec_decode_acceptance_rate"] == 30 / 120
    assert m["spec_decode_mean_acceptance_length"] == 1 + 30 / 40
