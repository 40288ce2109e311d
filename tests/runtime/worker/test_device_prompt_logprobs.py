"""Prompt logprobs on the CUDA table (under the SIMT emulator, as tests/runtime/worker/test_device_step.py runs
it): a step with prompt-logprob rows leaves the device step for the eager path, and returns the
log-softmax of the model's own logits at those rows (the same table's forward over a fresh cache,
all rows), the prompt tokens, their ranks and the top K.
"""

from __future__ import annotations

import numpy as np

from folio.model.attention_metadata import AttentionMetadata
from folio.model.loader import allocate_kv_caches
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.common.step import NewSequence, StepPlan
from support.device_cases import BS, CountingDevice, make_runner, make_table, model_dir

K = 6


def test_prompt_logprobs_on_the_cuda_table(modules, tmp_path, monkeypatch):
    runner = make_runner(monkeypatch, make_table(modules, CountingDevice()), model_dir(tmp_path))
    prompt = np.random.default_rng(4).integers(3, 200, 11).tolist()
    n = len(prompt)
    pos = np.arange(n, dtype=np.int64)
    blocks = np.arange(-(-n // BS), dtype=np.int32)
    slots = blocks[pos // BS].astype(np.int64) * BS + pos % BS
    plan = StepPlan(step_id=0, input_ids=np.asarray(prompt, np.int64), positions=pos, slot_mapping=slots,
                    query_start_loc=np.array([0, n], np.int32), seq_lens=np.array([n], np.int32),
                    block_tables=blocks[None, :], seq_ids=np.array([0], np.int64),
                    logits_indices=np.array([n - 1], np.int64), sample_seq_ids=np.array([0], np.int64),
                    new_seqs=[NewSequence(0, prompt, [], SamplingParams(temperature=0.0, prompt_logprobs=K).to_dict(),
                                          None, [2])],
                    prompt_logprob_indices=np.arange(n - 1, dtype=np.int64),
                    prompt_logprob_token_ids=np.asarray(prompt[1:], np.int64))
    res = runner.execute(plan)
    assert res.error is None, res.error
    # the same table's forward of the same tokens into a fresh cache, every row's logits
    md = AttentionMetadata(slot_mapping=slots, query_start_loc=plan.query_start_loc, seq_lens=plan.seq_lens,
                           block_tables=plan.block_tables, max_query_len=n, max_seq_len=n)
    caches = allocate_kv_caches(runner.model_config, len(blocks), BS, runner.kernels)
    logits = np.asarray(runner.model.forward(plan.input_ids, pos, md, caches, np.arange(n - 1))).astype(np.float64)
    ref = logits - logits.max(axis=1, keepdims=True)
    ref -= np.log(np.exp(ref).sum(axis=1, keepdims=True))
    tgt = np.asarray(prompt[1:])
    assert res.prompt_logprob_token_ids[:, 0].tolist() == prompt[1:]
    # the runner's float32 log-softmax (runtime/worker/sampler.log_softmax) of these same float32
    # logits against float64, u = 2^-24: z = l - max rounds by u |z|; each exp is within 4 ulp
    # (NumPy's float32 exp and log: < 4 ulp), 8u relative; the sum S of V positive terms is within
    # gamma_{V-1} + 8u relative in any order, so log S within that absolute, plus log's own 8u log S;
    # the last subtraction u |lp|. With |z| <= |lp| + log S: |err| <= u (2 |lp| + 9 log S) + gamma_{V-1}
    # + 8u. For V = 211, gamma_210 alone is 1.25e-5 (a flat 1e-5 held only by this data's luck).
    u, V = 2.0 ** -24, logits.shape[1]
    log_s = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1, keepdims=True))

    def within_bound(got, want):
        bound = u * (2 * np.abs(want) + 9 * log_s) + (V - 1) * u / (1 - (V - 1) * u) + 8 * u
        np.testing.assert_array_less(np.abs(got - want), bound)

    within_bound(res.prompt_logprobs[:, :1], ref[np.arange(n - 1), tgt][:, None])
    within_bound(res.prompt_logprobs[:, 1:], -np.sort(-ref, axis=1)[:, :K])
    assert res.prompt_logprob_ranks.tolist() == [1 + int((r > r[t]).sum()) for r, t in zip(ref, tgt)]
    assert res.sampled_token_ids.tolist() == [int(np.argmax(res_row)) for res_row in
                                              np.asarray(runner.model.forward(plan.input_ids, pos, md, caches,
                                                                              np.array([n - 1])))]
    runner.shutdown()
