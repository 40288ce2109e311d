"""Speculative decoding (n-gram proposer) on the default model, end to end through ``folio.LLM``.

Greedy output with speculation must be the output without it, token for token: the golden cases of
tests/data/smollm2_135m.json (Hugging Face transformers on the same weights, an independent
implementation), alone and batched beside prompts the n-gram proposer does well on, in a KV cache
small enough to preempt, with prefix caching and chunked prefill, with and without overlap
scheduling; the logprobs of accepted tokens are those of one token per step; seeded sampling
gives the tokens it gives without speculation.

One ``ModelRunner`` serves every engine here: the engines without speculation over its blocks
``[0, 128)``, those with it over ``[128, 256)`` (``Pool``), so that neither reads a cached block
the other overwrote; engines on the same side are never used again after another ran.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from folio import LLM, SamplingParams
from folio.runtime.common.config import EngineConfig

from support.numerics import forward_logit_atol

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1,
         "disable_by_batch_size": 8}
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])

CODE = '''def area(width, height):
    """Area of a rectangle."""
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
'''
# input-grounded requests: the answer copies long spans of the prompt
GROUNDED = [
    [{"role": "user", "content": "Rename the parameter width to w in this code and show the whole code:\n\n" + CODE}],
    [{"role": "user", "content": "Repeat this sentence exactly: The committee will meet on Tuesday at the "
                                 "north entrance of the library, and every member should bring the report."}],
]


class Pool:
    """The shared runner's blocks ``[offset, offset + num_blocks)``, seen as blocks from 0."""

    def __init__(self, runner, offset, num_blocks):
        self._runner = runner
        self.offset = offset
        self.num_blocks = num_blocks
        self.model_config = runner.model_config
        self.model_dir = runner.model_dir

    def execute(self, plan):
        slots = plan.slot_mapping.copy()
        slots[slots >= 0] += self.offset * self._runner.block_size
        return self._runner.execute(dataclasses.replace(
            plan, slot_mapping=slots, block_tables=plan.block_tables + self.offset,
            block_copies=plan.block_copies + self.offset))

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def runner():
    from folio.runtime.worker.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(device="cpu", num_kv_blocks_override=256))
    yield r
    r.shutdown()


def make_llm(runner, spec=NGRAM, num_blocks=128, **kw):
    pool = Pool(runner, 0 if spec is None else 128, num_blocks)
    return LLM(executor=pool, device="cpu", speculative_config=spec, **kw)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@OVERLAP
def test_golden_cases_alone(runner, golden, overlap):
    llm = make_llm(runner, async_scheduling=overlap)
    for case in golden["greedy_cases"]:
        out = llm.generate({"prompt_token_ids": case["prompt_ids"]}, greedy(32), use_tqdm=False)[0]
        assert out.outputs[0].token_ids == case["generated_ids_32_ignore_eos"], case["id"]
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0
    assert m["num_free_blocks"] == m["num_total_blocks"]


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "overlap"])
def test_batched_in_a_tiny_cache_with_grounded_prompts(runner, golden, overlap):
    plain = make_llm(runner, spec=None)
    tok = plain.get_tokenizer()
    grounded = [tok.encode(tok.apply_chat_template(m)) for m in GROUNDED]
    want = token_ids(plain.generate([{"prompt_token_ids": p} for p in grounded], greedy(48), use_tqdm=False))
    cases = golden["greedy_cases"]
    prompts = [c["prompt_ids"] for c in cases] + grounded
    # 30 blocks of 16: the 300-token case alone needs 21, so the batch preempts
    llm = make_llm(runner, num_blocks=30, async_scheduling=overlap, enable_prefix_caching=False,
                   max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [greedy(32)] * len(cases) + [greedy(48)] * len(grounded), use_tqdm=False)
    assert token_ids(outs) == [c["generated_ids_32_ignore_eos"] for c in cases] + want
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0
    assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]
    assert m["num_free_blocks"] == 30


def test_prefix_caching_and_chunked_prefill(runner):
    plain = make_llm(runner, spec=None)
    tok = plain.get_tokenizer()
    grounded = [tok.encode(tok.apply_chat_template(m)) for m in GROUNDED]
    want = token_ids(plain.generate([{"prompt_token_ids": p} for p in grounded], greedy(40), use_tqdm=False))
    llm = make_llm(runner, max_num_batched_tokens=48)
    first = llm.generate([{"prompt_token_ids": p} for p in grounded], greedy(40), use_tqdm=False)
    # the same prompts again, and each extended by its own answer: hits on prompt and answer blocks
    again = llm.generate([{"prompt_token_ids": p} for p in grounded], greedy(40), use_tqdm=False)
    longer = [p + w for p, w in zip(grounded, want)]
    plain_longer = plain.generate([{"prompt_token_ids": p} for p in longer], greedy(16), use_tqdm=False)
    ext = llm.generate([{"prompt_token_ids": p} for p in longer], greedy(16), use_tqdm=False)
    assert token_ids(first) == want and token_ids(again) == want and token_ids(ext) == token_ids(plain_longer)
    assert all(o.num_cached_tokens > 0 for o in again + ext)
    # accepted drafts' blocks are cached as a decode's are: at least as many hits as without drafts
    assert all(o.num_cached_tokens >= q.num_cached_tokens > len(p) // 2 for o, q, p in zip(ext, plain_longer, longer))
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0 and m["num_free_blocks"] == 128


def test_logprobs_and_n_samples_of_accepted_tokens(runner):
    plain = make_llm(runner, spec=None)
    tok = plain.get_tokenizer()
    p = tok.encode(tok.apply_chat_template(GROUNDED[0]))
    sp = greedy(40, logprobs=3, n=2)
    a = plain.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
    llm = make_llm(runner)
    b = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
    assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    # the verifying rows run the multi-token attention and products instead of a decode's: another
    # float32 summation order. A logprob is a logit minus a log-sum-exp, each within the logit
    # bound of two schedules (support.numerics); the logits' magnitude from one whole prefill
    c = runner.model_config
    tol = 2 * forward_logit_atol(c.num_hidden_layers, max(c.hidden_size, c.intermediate_size),
                                 max_abs_logits(runner, p + a.outputs[0].token_ids))
    for x, y in zip(a.outputs, b.outputs):
        assert x.token_ids == y.token_ids
        assert len(y.logprobs) == len(y.token_ids)
        for lx, ly in zip(x.logprobs, y.logprobs):
            assert set(lx) == set(ly)
            for t in lx:
                assert abs(lx[t].logprob - ly[t].logprob) <= tol, (t, lx[t], ly[t])
                assert lx[t].rank == ly[t].rank
        assert abs(x.cumulative_logprob - y.cumulative_logprob) <= tol * len(x.token_ids)


def max_abs_logits(runner, tokens) -> np.ndarray:
    """``[1]`` the largest logit magnitude over every position of ``tokens``, one prefill over a
    fresh KV cache."""
    from folio.model.attention_metadata import AttentionMetadata
    from folio.model.loader import allocate_kv_caches
    n, bs = len(tokens), runner.block_size
    nb = -(-n // bs)
    caches = allocate_kv_caches(runner.model_config, nb, bs, runner.kernels)
    md = AttentionMetadata(np.arange(n, dtype=np.int64), np.array([0, n], np.int32), np.array([n], np.int32),
                           np.arange(nb, dtype=np.int32)[None, :], n, n)
    logits = runner.model.forward(np.array(tokens, np.int64), np.arange(n, dtype=np.int64), md, caches,
                                  np.arange(n, dtype=np.int64))
    return np.array([np.abs(np.asarray(logits)).max()])


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "overlap"])
def test_seeded_sampling_with_drafts_equals_sampling_without(runner, overlap):
    """With temperature, top-k / top-p / min-p and a seed, the tokens are those of the same request
    without speculation: each verified row draws its sequence's next uniform and the generator
    keeps only the draws of the tokens emitted (runtime/worker/spec_decode.py), so a draft is
    accepted exactly when the target samples it. Also for n = 2 (each sample's derived seed)."""
    plain = make_llm(runner, spec=None, async_scheduling=overlap)
    tok = plain.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template(m)) for m in GROUNDED]
    sps = [SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=40),
           SamplingParams(temperature=1.0, top_k=20, min_p=0.02, seed=11, max_tokens=40, n=2)]
    want = [[c.token_ids for c in o.outputs] for o in
            plain.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)]
    llm = make_llm(runner, async_scheduling=overlap)
    got = [[c.token_ids for c in o.outputs] for o in
           llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)]
    assert got == want
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0 and m["num_free_blocks"] == 128
