"""``SamplingParams.prompt_logprobs`` on the real default model against the logits of one full
prefill of the prompt (no KV cache reused, tests/support/llama_forward.run_paged), cold and with the
prompt's blocks already in the prefix cache, chunked, forked (n > 1) and batched.

Tolerance, from the arithmetic (as tests/runtime/scheduler/test_beam_search.py): every schedule of the forward stays
within ``numerics.forward_logit_atol`` of a whole prefill (the bound tests/model/test_forward.py holds
for chunked and token-by-token schedules), a logprob (``logit - logsumexp``, the logsumexp moving by
at most the largest logit change) within twice that (``lp_tol``), and a comparison of two logprobs
within twice that again; ranks and the top-k set are checked up to ties inside that tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from folio import LLM, SamplingParams
from folio.runtime.common.config import EngineConfig
from support.engine_cases import BlockRegion
from support.numerics import forward_logit_atol
from support.llama_forward import max_dot_len, run_paged

TEXT = ("The following is a short poem about autumn leaves falling slowly from the trees, written by a "
        "child who loves the colours of October, the smell of rain and the long walks home from school:")
K = 5


@pytest.fixture(scope="module")
def runner():
    from folio.runtime.worker.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(device="cpu", num_kv_blocks_override=96))
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def prompt(runner):
    from folio.model.tokenizer import Tokenizer
    ids = Tokenizer.from_pretrained(runner.model_dir).encode(TEXT)
    assert len(ids) > 32   # more than two blocks of 16: a warm cache holds part of it
    return ids


@pytest.fixture(scope="module")
def prefill_logits(runner, prompt):
    """``[P, V]`` float32 logits of every position, one whole prefill."""
    return run_paged(runner.model, runner.model_config, prompt, len(prompt))


@pytest.fixture(scope="module")
def reference(prefill_logits):
    """``[P, V]`` float64 log-softmax of every position's logits, one whole prefill."""
    x = prefill_logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@pytest.fixture(scope="module")
def lp_tol(runner, prefill_logits):
    """Largest error of one logprob: twice the logit bound of two float32 schedules."""
    c = runner.model_config
    return 2 * forward_logit_atol(c.num_hidden_layers, max_dot_len(c), prefill_logits)


def check(plp, prompt, ref, tol, k=K):
    assert len(plp) == len(prompt) and plp[0] is None
    for i in range(1, len(prompt)):
        row, t, entry = ref[i - 1], prompt[i], plp[i]
        assert abs(entry[t].logprob - row[t]) <= tol
        # the engine's rank counts its own values: within the tolerance of the reference's count
        assert 1 + (row > row[t] + 2 * tol).sum() <= entry[t].rank <= 1 + (row > row[t] - 2 * tol).sum()
        # the top k (and the prompt token, if not among them), each a top-k token of the
        # reference up to ties within the tolerance
        assert len(entry) in (k, k + 1) and (len(entry) == k) == (entry[t].rank <= k)
        kth = np.sort(row)[-k] if k else np.inf
        for tok, lp in entry.items():
            assert abs(lp.logprob - row[tok]) <= tol
            if tok != t or entry[t].rank <= k:
                assert row[tok] >= kth - 2 * tol


def make_llm(runner, offset, num_blocks, **kw):
    return LLM(executor=BlockRegion(runner, offset, num_blocks), device="cpu", **kw)


def test_prompt_logprobs_cold_warm_chunked_forked(runner, prompt, reference, lp_tol):
    llm = make_llm(runner, 0, 96, max_num_batched_tokens=2048)
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K)
    cold = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    check(cold.prompt_logprobs, prompt, reference, lp_tol)
    # the prompt's full blocks are now cached: a plain request reads them, one asking for prompt
    # logprobs computes every position again and gets the same values
    plain = llm.generate({"prompt_token_ids": prompt}, sp.clone(prompt_logprobs=None), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 16 * ((len(prompt) - 1) // 16) and plain.prompt_logprobs is None
    warm = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    check(warm.prompt_logprobs, prompt, reference, lp_tol)
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids == plain.outputs[0].token_ids
    # chunked (7 tokens a step), forked (n = 2: the parent computes the prompt), with 0 top logprobs
    chunked = make_llm(runner, 0, 96, max_num_batched_tokens=7)
    out = chunked.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": prompt[:9]}],
                           [sp, SamplingParams(n=2, temperature=0.0, max_tokens=1, prompt_logprobs=0)],
                           use_tqdm=False)
    check(out[0].prompt_logprobs, prompt, reference, lp_tol)
    assert [len(e) for e in out[1].prompt_logprobs[1:]] == [1] * 8
    for i in range(1, 9):
        assert abs(out[1].prompt_logprobs[i][prompt[i]].logprob - reference[i - 1][prompt[i]]) <= lp_tol
    m = chunked.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
