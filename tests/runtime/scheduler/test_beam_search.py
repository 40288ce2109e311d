"""Beam search on the real default model (SmolLM2-135M-Instruct, CPU) against an independent NumPy
beam search (tests/support/beam_reference.py) over the model's own logits computed without the KV cache:
every prefix the reference looks at is a fresh full prefill (tests/support/llama_forward.run_paged), no
K/V reused from one step to the next, while the engine decodes its beams over shared, forked and
copied-on-write blocks.

Tolerance, from the arithmetic: the engine and the reference compute the same float32 logits in
different schedules (batched decode over the paged cache vs one whole prefill). tests/model/test_forward.py
holds every schedule of the forward to within ``numerics.forward_logit_atol`` of a whole prefill
(absolute, per logit; it scales with the largest logit, here the largest the reference saw on
any prefix). A logprob is ``logit - logsumexp(logits)`` and logsumexp moves by at most the largest
logit change, so a logprob is off by at most 2 * that bound (``delta``), a cumulative logprob of n
tokens by ``delta * n``, and a comparison of two by twice that. The reference reports every decision
that shaped its result with the gap it had; each must exceed that tolerance (the prompts are
chosen so: a near-tie would make either answer right), and then the engine must give exactly the
reference's token ids, with cumulative logprobs within the bound.
"""

from __future__ import annotations

import numpy as np
import pytest

from support.beam_reference import reference_beam_search
from folio import LLM, BeamSearchParams, SamplingParams
from folio.runtime.common.config import EngineConfig
from support.numerics import forward_logit_atol
from support.engine_cases import BlockRegion
from support.llama_forward import max_dot_len

NUM_BLOCKS = 320
BLOCK_SIZE = 4   # small blocks: prompts and beams cross block boundaries, forks share partial blocks


@pytest.fixture(scope="module")
def runner():
    from folio.runtime.worker.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(device="cpu", block_size=BLOCK_SIZE, num_kv_blocks_override=NUM_BLOCKS))
    yield r
    r.shutdown()


def fresh_prefill_logits(model, config, prefixes) -> np.ndarray:
    """``[S, V]`` float32 logits after each prefix: one forward in which every prefix is a whole
    prefill into its own fresh blocks (a batch of independent full recomputes, no cached K/V)."""
    from folio.model.attention_metadata import AttentionMetadata
    from folio.model.loader import allocate_kv_caches
    bs = 16
    lens = [len(p) for p in prefixes]
    nblk = [-(-n // bs) for n in lens]
    first = np.concatenate([[0], np.cumsum(nblk)[:-1]]).astype(np.int64)
    table = np.zeros((len(prefixes), max(nblk)), np.int32)
    for i, (f, n) in enumerate(zip(first, nblk)):
        table[i, :n] = np.arange(f, f + n)
    caches = allocate_kv_caches(config, int(sum(nblk)), bs, model.kernels)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    seq = np.repeat(np.arange(len(prefixes)), lens)
    md = AttentionMetadata(slot_mapping=table[seq, pos // bs].astype(np.int64) * bs + pos % bs,
                           query_start_loc=qsl, seq_lens=np.asarray(lens, np.int32), block_tables=table,
                           max_query_len=max(lens), max_seq_len=max(lens))
    ids = np.concatenate([np.asarray(p, np.int64) for p in prefixes])
    return model.forward(ids, pos, md, caches, qsl[1:].astype(np.int64) - 1)


@pytest.fixture(scope="module")
def full_logprobs(runner):
    """``prefixes -> [V]`` float64 log-softmax of the logits after each prefix, each a fresh full
    prefill (memoised: beams of different widths share prefixes)."""
    cache = {}

    def fn(prefixes):
        todo = list(dict.fromkeys(tuple(p) for p in prefixes if tuple(p) not in cache))
        if todo:
            logits = fresh_prefill_logits(runner.model, runner.model_config, todo).astype(np.float64)
            fn.max_abs_logit = max(fn.max_abs_logit, float(np.abs(logits).max()))
            logits -= logits.max(axis=1, keepdims=True)
            logits -= np.log(np.exp(logits).sum(axis=1, keepdims=True))
            cache.update(zip(todo, logits))
        return [cache[tuple(p)] for p in prefixes]
    fn.max_abs_logit = 0.0
    return fn


def make_llm(runner, offset, num_blocks, **kw):
    return LLM(executor=BlockRegion(runner, offset, num_blocks), device="cpu", block_size=BLOCK_SIZE, **kw)


# (prompt, beam_width, max_tokens, length_penalty): prompt lengths 1 to 30 tokens, widths 1
# (greedy) to 8; the chat prompts make the instruct model answer briefly and end with EOS
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
CASES = [("Hello", 8, 3, 1.0),
         ("The capital of France is", 7, 4, 2.0),
         ("def fibonacci(n):", 1, 8, 1.0),
         ("Once upon a time, in a small village by the sea, there lived", 2, 6, 0.5),
         ("Q: What is the largest planet in the solar system?\nA:", 3, 4, 1.0),
         ("import numpy as", 6, 3, 2.0),
         (CHAT.format("What is 2+2? Answer with one number."), 4, 6, 1.0),
         (CHAT.format("Say yes or no."), 5, 8, 1.0)]


def check(out, ref_seqs, delta):
    got = [(s.token_ids, s.finish_reason) for s in out.sequences]
    assert got == [(ids, reason) for ids, _, reason in ref_seqs]
    for s, (ids, cum, reason) in zip(out.sequences, ref_seqs):
        n = len(ids) + (reason == "stop")  # logprobs summed (an EOS's too)
        assert abs(s.cum_logprob - cum) <= delta * max(n, 1)


class Cases(list):
    """``(prompt ids, params, reference sequences)`` per case; ``delta``: the largest error of one
    logprob of the engine against the reference (module docstring)."""

    delta: float


@pytest.fixture(scope="module")
def cases(runner, full_logprobs):
    tok = runner_tokenizer(runner)
    c = runner.model_config
    searches = [(tok.encode(text), BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty))
                for text, width, max_tokens, penalty in CASES]
    # the search path does not depend on delta (it only decides which decisions are reported):
    # a first pass visits every prefix and so finds the largest logit, a second (memoised)
    # reports the decision gaps against the bound that logit gives
    for ids, params in searches:
        reference_beam_search(full_logprobs, ids, params, c.eos_token_ids)
    out = Cases()
    out.delta = 2 * forward_logit_atol(c.num_hidden_layers, max_dot_len(c), np.array([full_logprobs.max_abs_logit]))
    ties = []
    for (text, width, _, _), (ids, params) in zip(CASES, searches):
        ref, gaps = reference_beam_search(full_logprobs, ids, params, c.eos_token_ids, delta=out.delta)
        ties += [(text, width, g, tol, what) for g, tol, what in gaps if g <= tol]
        out.append((ids, params, ref))
    assert not ties, f"near-ties make either answer right (choose other cases): {ties}"
    return out


def runner_tokenizer(runner):
    from folio.model.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(runner.model_dir)


def run_all(llm, cases, extra=()):
    """Every search (and ``extra`` ordinary requests) in one engine at once; the beam outputs."""
    from folio.runtime.scheduler.beam_search import BeamSearchOutput
    from folio.runtime.common.outputs import RequestOutput
    engine = llm.llm_engine
    for i, (ids, params, _) in enumerate(cases):
        engine.add_request(f"b{i}", None, params, prompt_token_ids=ids)
    for i, (ids, sp) in enumerate(extra):
        engine.add_request(f"x{i}", None, sp, prompt_token_ids=ids)
    finals = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.finished:
                finals[d.request_id] = d
    return [BeamSearchOutput.from_request_output(RequestOutput.from_deltas([finals[f"b{i}"]]))
            for i in range(len(cases))]


def test_beam_search_equals_full_recompute_reference(runner, cases):
    assert min(len(ids) for ids, _, _ in cases) == 1 and max(len(ids) for ids, _, _ in cases) > 12
    assert any(reason == "stop" for _, _, ref in cases for _, _, reason in ref)   # some beam ends at EOS
    assert {p.beam_width for _, p, _ in cases} == set(range(1, 9))
    llm = make_llm(runner, 0, 160)
    ids, params, ref = cases[1]
    check(llm.beam_search({"prompt_token_ids": ids}, params)[0], ref, cases.delta)   # the offline API, one prompt
    for out, (_, _, ref) in zip(run_all(llm, cases), cases):           # all at once
        check(out, ref, cases.delta)
    m = llm.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_width_one_is_greedy(runner, cases):
    llm = make_llm(runner, 0, 160)
    ids, params, ref = next(c for c in cases if c[1].beam_width == 1)
    greedy = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=params.max_tokens),
                          use_tqdm=False)[0].outputs[0]
    beam = llm.beam_search({"prompt_token_ids": ids}, params)[0].sequences
    assert len(beam) == 1 and beam[0].token_ids == greedy.token_ids == ref[0][0]


def test_beams_under_preemption_pressure_equal_ample_memory(runner, cases):
    # every search at once, with an ordinary request, in 48 blocks of 4 tokens: beams are
    # preempted, recomputed (prefill instead of decode: a different rounding, inside the
    # tolerance) and forked again
    llm = make_llm(runner, 160, 48, max_num_batched_tokens=24)
    other = runner_tokenizer(runner).encode("The quick brown fox jumps over the lazy dog.")
    outs = run_all(llm, cases, [(other, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))])
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0
    assert m["num_free_blocks"] == m["num_total_blocks"]
    for out, (_, _, ref) in zip(outs, cases):
        check(out, ref, cases.delta)
