"""Scheduler and engine loop with a fake executor (no model, tests/support/fake_executor.py).

The fake worker keeps a simulated KV cache of token ids: it performs the plan's block copies,
writes every input token at its slot, and checks that each sequence's context read back through
its block table is exactly the tokens it has seen for that sequence (prompt + sampled). The token
it "samples" is a fixed function of that whole history (and the seed), so any scheduling path -
batched, chunked, preempted, forked, prefix-cached - must produce the tokens of a plain loop.
"""

from __future__ import annotations

import numpy as np
import pytest

from perf.bench.static_batching import StaticBatchScheduler
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID, StepResult

from support.fake_executor import V, FakeExecutor, FakeTokenizer, RecordingEngine, expected, prompt


def sample_seed(seed, index, n):
    """The seed sample ``index`` of an ``n``-sample seeded request must get, re-derived here from
    the documented encoding (not by calling ``derive_seed``): the request's seed when ``n == 1``,
    else the first 8 bytes of sha256("folio-sample:{seed}:{index}"), little-endian, shifted right
    by one (63 bits). Seeded results must stay reproducible across releases, so the encoding is
    pinned."""
    import hashlib
    if n == 1:
        return seed
    return int.from_bytes(hashlib.sha256(f"folio-sample:{seed}:{index}".encode()).digest()[:8], "little") // 2


def make_engine(num_blocks=64, scheduler_cls=None, **kw):
    """An engine over the fake worker; one step per ``step()`` unless ``async_scheduling=True``."""
    kw.setdefault("block_size", 4)
    kw.setdefault("async_scheduling", False)
    config = EngineConfig(**kw)
    ex = FakeExecutor(num_blocks, config.block_size)
    extra = {"scheduler_cls": scheduler_cls} if scheduler_cls else {}
    return RecordingEngine(config, executor=ex, tokenizer=FakeTokenizer(), **extra), ex


def run(engine, max_steps=10_000):
    """Step until idle; the cumulative output of every request that finished so far."""
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    return {rid: engine.final(rid) for rid, ds in engine.deltas.items() if ds[-1].finished}


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


def assert_idle(engine):
    m = engine.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    assert m["num_running"] == 0 and m["num_waiting"] == 0


@OVERLAP
def test_batched_equals_plain_loop_and_pool_returns(overlap):
    engine, ex = make_engine(max_num_batched_tokens=32, async_scheduling=overlap)
    prompts = [prompt(n, n) for n in (1, 3, 4, 5, 9, 17, 30)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), None, SamplingParams(max_tokens=6), prompt_token_ids=p)
    final = run(engine)
    for i, p in enumerate(prompts):
        assert final[str(i)].outputs[0].token_ids == expected(p, 6)
        assert final[str(i)].outputs[0].finish_reason == "length"
    assert all(plan.num_tokens <= 32 for plan in ex.plans)
    assert_idle(engine)


def test_decode_first_then_oldest_prefill_chunked():
    engine, ex = make_engine(max_num_batched_tokens=8)
    engine.add_request("a", None, SamplingParams(max_tokens=5), prompt_token_ids=prompt(3))
    engine.step()  # a: prefill of 3
    engine.add_request("b", None, SamplingParams(max_tokens=2), prompt_token_ids=prompt(20, 1))
    engine.add_request("c", None, SamplingParams(max_tokens=2), prompt_token_ids=prompt(5, 2))
    engine.step()
    plan = ex.plans[-1]
    # a decodes first (1 token), b (older) gets the remaining 7 as a chunk, c waits
    seq_a, seq_b = engine.scheduler.running[0], engine.scheduler.running[1]
    assert list(plan.seq_ids) == [seq_a.seq_id, seq_b.seq_id]
    assert np.diff(plan.query_start_loc).tolist() == [1, 7]
    assert list(plan.sample_seq_ids) == [seq_a.seq_id]  # a chunk in the middle samples nothing
    engine.step()
    assert np.diff(ex.plans[-1].query_start_loc).tolist() == [1, 7]
    engine.step()  # b's last 6 tokens, then c gets 1 token of budget
    assert np.diff(ex.plans[-1].query_start_loc).tolist() == [1, 6, 1]
    final = run(engine)
    assert final["b"].outputs[0].token_ids == expected(prompt(20, 1), 2)
    assert final["c"].outputs[0].token_ids == expected(prompt(5, 2), 2)


def test_without_chunking_a_prefill_waits_for_room():
    engine, ex = make_engine(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16)
    engine.add_request("a", None, SamplingParams(max_tokens=2), prompt_token_ids=prompt(10))
    engine.add_request("b", None, SamplingParams(max_tokens=2), prompt_token_ids=prompt(10, 3))
    engine.step()
    assert np.diff(ex.plans[-1].query_start_loc).tolist() == [10]
    engine.step()
    assert np.diff(ex.plans[-1].query_start_loc).tolist() == [1, 10]
    final = run(engine)
    assert final["b"].outputs[0].token_ids == expected(prompt(10, 3), 2)


def test_max_num_seqs_caps_every_step():
    engine, ex = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(str(i), None, SamplingParams(max_tokens=3), prompt_token_ids=prompt(4, i))
    final = run(engine)
    assert max(len(p.seq_ids) for p in ex.plans) == 2
    assert all(final[str(i)].outputs[0].token_ids == expected(prompt(4, i), 3) for i in range(5))


@OVERLAP
def test_preemption_by_recompute_keeps_outputs(overlap):
    # 10 blocks of 4 tokens: three requests of 6 + 14 tokens cannot all stay resident
    engine, ex = make_engine(num_blocks=10, async_scheduling=overlap)
    ps = [prompt(6, i) for i in range(3)]
    for i, p in enumerate(ps):
        engine.add_request(str(i), None, SamplingParams(max_tokens=14), prompt_token_ids=p)
    final = run(engine)
    assert engine.get_metrics()["num_preemptions"] > 0
    for i, p in enumerate(ps):
        assert final[str(i)].outputs[0].token_ids == expected(p, 14)
    assert_idle(engine)


def test_preempts_the_newest_running_sequence():
    engine, ex = make_engine(num_blocks=4)
    engine.add_request("old", None, SamplingParams(max_tokens=7), prompt_token_ids=prompt(6))
    engine.step()
    engine.add_request("new", None, SamplingParams(max_tokens=7), prompt_token_ids=prompt(5, 1))
    engine.step()
    sched = engine.scheduler
    assert [s.request.request_id for s in sched.running] == ["old", "new"]
    # 4 blocks of 4 slots, 2 held by each: "old" (6 prompt tokens, 2 computed since) needs a third
    # block for its 9th token two steps from now; none is free, so the newest sequence is preempted
    for _ in range(2):
        engine.step()
    assert sched.num_preemptions == 1
    assert sched.waiting[0].request.request_id == "new"
    run(engine)


@OVERLAP
def test_prefix_cache_hit_same_step_and_later(overlap):
    engine, ex = make_engine(async_scheduling=overlap)
    p = prompt(13, 4)
    engine.add_request("a", None, SamplingParams(max_tokens=3), prompt_token_ids=p)
    engine.add_request("b", None, SamplingParams(max_tokens=3), prompt_token_ids=p)
    final = run(engine)
    assert final["b"].num_cached_tokens == 12  # a's blocks, registered in the same step
    engine.add_request("c", None, SamplingParams(max_tokens=3), prompt_token_ids=p + [1])
    engine.add_request("d", None, SamplingParams(max_tokens=3), prompt_token_ids=p, cache_salt="t")
    final.update(run(engine))
    assert final["c"].num_cached_tokens == 12 and final["d"].num_cached_tokens == 0
    for r in "ab":
        assert final[r].outputs[0].token_ids == expected(p, 3)
    assert final["c"].outputs[0].token_ids == expected(p + [1], 3)
    m = engine.get_metrics()
    assert m["prefix_cache_hits"] == 24 and m["num_cached_blocks"] > 0
    assert_idle(engine)


def test_fork_n_samples_share_blocks_with_copy_on_write():
    engine, ex = make_engine()
    p = prompt(7)  # parent computes 6 tokens: block 1 half full, shared by the samples
    engine.add_request("n", None, SamplingParams(n=3, seed=5, max_tokens=6), prompt_token_ids=p)
    engine.step()
    assert np.diff(ex.plans[-1].query_start_loc).tolist() == [6] and len(ex.plans[-1].logits_indices) == 0
    engine.step()
    plan = ex.plans[-1]
    assert np.diff(plan.query_start_loc).tolist() == [1, 1, 1]
    assert len(plan.block_copies) == 2  # two samples copy the shared partial block, the last keeps it
    assert len(set(plan.block_tables[:, 0].tolist())) == 1  # the full block stays shared
    final = run(engine)
    outs = final["n"].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    for o in outs:
        assert o.token_ids == expected(p, 6, sample_seed(5, o.index, 3))
    assert len({tuple(o.token_ids) for o in outs}) == 3
    assert_idle(engine)


def test_static_policy_admits_next_batch_only_after_previous_finished():
    engine, ex = make_engine(max_num_seqs=2, scheduler_cls=StaticBatchScheduler)
    lens = [2, 9, 3, 3]
    for i, m in enumerate(lens):
        engine.add_request(str(i), None, SamplingParams(max_tokens=m), prompt_token_ids=prompt(4, i))
    first_step = {}
    finish_step = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for o in engine.step():
            first_step.setdefault(o.request_id, step)
            if o.finished:
                finish_step[o.request_id] = step
    assert first_step["2"] > max(finish_step["0"], finish_step["1"])
    assert first_step["3"] == first_step["2"]


def test_validation_happens_before_any_allocation():
    engine, ex = make_engine(num_blocks=8, max_model_len=32)
    free = engine.get_metrics()["num_free_blocks"]
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", None, SamplingParams(), prompt_token_ids=[])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("l", None, SamplingParams(max_tokens=2), prompt_token_ids=prompt(31))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("v", None, SamplingParams(), prompt_token_ids=[V + 3])
    small, _ = make_engine(num_blocks=6, max_model_len=32)
    with pytest.raises(ValueError, match="blocks"):
        small.add_request("k", None, SamplingParams(max_tokens=8), prompt_token_ids=prompt(20))
    assert engine.get_metrics()["num_free_blocks"] == free and not engine.has_unfinished_requests()
    engine.add_request("z", None, SamplingParams(max_tokens=0), prompt_token_ids=prompt(3))
    (out,) = engine.step()
    assert out.finished and out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    engine.add_request("ok", None, SamplingParams(max_tokens=1), prompt_token_ids=prompt(31))
    assert run(engine)["ok"].outputs[0].token_ids == expected(prompt(31), 1)


@OVERLAP
def test_stop_token_ids_and_text(overlap):
    engine, ex = make_engine(async_scheduling=overlap)
    p = prompt(5)
    full = expected(p, 8)
    stop_tok = full[3]
    engine.add_request("s", None, SamplingParams(max_tokens=8, stop_token_ids=[stop_tok]), prompt_token_ids=p)
    out = run(engine)["s"].outputs[0]
    k = full.index(stop_tok)
    assert out.token_ids == full[:k + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.text == FakeTokenizer().decode(full[:k])


def test_metrics_counters_and_request_times():
    engine, ex = make_engine()
    engine.add_request("m", None, SamplingParams(max_tokens=4), prompt_token_ids=prompt(10))
    final = run(engine)
    met = final["m"].metrics
    assert met.arrival_time <= met.first_scheduled_time <= met.first_token_time <= met.finished_time
    m = engine.get_metrics()
    # 64 blocks of 4, all free again; the 13 computed tokens (10 prompt + 3 of the 4 sampled) filled
    # 3 blocks, which stay registered in the prefix cache; one lookup of the 10 prompt tokens, no hit
    assert (m["num_total_blocks"], m["num_free_blocks"], m["num_cached_blocks"]) == (64, 64, 3)
    assert (m["prefix_cache_queries"], m["prefix_cache_hits"], m["num_preemptions"]) == (10, 0, 0)
    assert (m["kv_tokens_held"], m["kv_tokens_allocated"]) == (0, 0)


class FailingOnce(FakeExecutor):
    def __init__(self, *a, fail_at=2, **kw):
        super().__init__(*a, **kw)
        self.fail_at = fail_at

    def execute(self, plan):
        if len(self.plans) + 1 == self.fail_at:
            self.plans.append(None)
            return StepResult(step_id=plan.step_id, sampled_token_ids=np.zeros(0, np.int64), error="boom")
        return super().execute(plan)


@OVERLAP
def test_failed_step_raises_and_requests_recover(overlap):
    # with overlap, step 3 (built on step 2's placeholders) was handed over before step 2's
    # failure was seen: both are undone
    config = EngineConfig(block_size=4, max_num_batched_tokens=8, async_scheduling=overlap)
    ex = FailingOnce(32, 4)
    engine = RecordingEngine(config, executor=ex, tokenizer=FakeTokenizer())
    p = prompt(14)
    engine.add_request("a", None, SamplingParams(max_tokens=3), prompt_token_ids=p)
    engine.step()
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()  # this chunk's blocks were never written: their hashes must not be served
    ex.history.clear()  # the worker restarts from the resent sampling state
    final = run(engine)
    assert final["a"].outputs[0].token_ids == expected(p, 3)
    assert_idle(engine)


@OVERLAP
@pytest.mark.parametrize("plen,num_blocks", [(1, 64), (9, 64), (9, 7), (8, 7)])
def test_n_samples_under_pressure_and_short_prompts(plen, num_blocks, overlap):
    # (9, 7) and (8, 7): four samples of 9 + 12 tokens cannot all hold their blocks: forked
    # samples are preempted and recomputed, shared prompt blocks included
    engine, ex = make_engine(num_blocks=num_blocks, async_scheduling=overlap)
    p = prompt(plen, 3)
    engine.add_request("n", None, SamplingParams(n=4, seed=9, max_tokens=12), prompt_token_ids=p)
    engine.add_request("o", None, SamplingParams(max_tokens=5), prompt_token_ids=prompt(5, 1))
    final = run(engine)
    for o in final["n"].outputs:
        assert o.token_ids == expected(p, 12, sample_seed(9, o.index, 4))
    assert final["o"].outputs[0].token_ids == expected(prompt(5, 1), 5)
    if num_blocks == 7:
        assert engine.get_metrics()["num_preemptions"] > 0
    assert_idle(engine)


# -- overlap scheduling, deltas, bounds ----------------------------------------------------------------

def seq_id_of(ex, prompt_ids):
    """The seq_id the fake worker was introduced to with this prompt (one sample)."""
    return next(ns.seq_id for pl in ex.plans for ns in pl.new_seqs if list(ns.prompt_token_ids) == prompt_ids)


def test_overlap_feeds_placeholders_and_discards_the_token_after_a_stop():
    engine, ex = make_engine(async_scheduling=True)
    p = prompt(5)
    full = expected(p, 8)
    stop_tok = full[3]
    engine.add_request("s", None, SamplingParams(max_tokens=8, stop_token_ids=[stop_tok]), prompt_token_ids=p)
    engine.add_request("m", None, SamplingParams(max_tokens=6), prompt_token_ids=prompt(3, 1))
    final = run(engine)
    # decode inputs were placeholders: plan N+1 left before step N's token was known
    assert sum(int((pl.input_ids == PLACEHOLDER_TOKEN_ID).sum()) for pl in ex.plans) > 0
    s_id = seq_id_of(ex, p)
    samples = sum(int((pl.sample_seq_ids == s_id).sum()) for pl in ex.plans)
    # it sampled its stop token in some step N; step N+1 was already scheduled with it: one token
    # too many was computed there and discarded
    assert samples == full.index(stop_tok) + 2
    assert final["s"].outputs[0].token_ids == full[:full.index(stop_tok) + 1]
    assert final["s"].outputs[0].finish_reason == "stop"
    # a sequence that reaches max_tokens is never scheduled past it
    m_id = seq_id_of(ex, prompt(3, 1))
    assert sum(int((pl.sample_seq_ids == m_id).sum()) for pl in ex.plans) == 6
    assert final["m"].outputs[0].token_ids == expected(prompt(3, 1), 6)
    assert_idle(engine)


@OVERLAP
def test_stop_string_under_overlap_cuts_text_and_tokens(overlap):
    engine, ex = make_engine(async_scheduling=overlap)
    p = prompt(5, 2)
    full = expected(p, 10)
    text = FakeTokenizer().decode(full)
    stop = text[4:6]   # spans tokens 4 and 5
    engine.add_request("t", None, SamplingParams(max_tokens=10, stop=[stop]), prompt_token_ids=p)
    out = run(engine)["t"].outputs[0]
    k = text.find(stop)
    assert out.text == text[:k] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full[:k + len(stop)]   # one character per token here
    assert_idle(engine)


@OVERLAP
def test_abort_while_a_step_is_in_flight(overlap):
    engine, ex = make_engine(async_scheduling=overlap)
    engine.add_request("x", None, SamplingParams(max_tokens=50), prompt_token_ids=prompt(9))
    engine.add_request("y", None, SamplingParams(max_tokens=12), prompt_token_ids=prompt(9, 5))
    for _ in range(4):
        engine.step()
    x_seq = engine.scheduler.requests["x"].seqs[0].seq_id
    engine.abort_request("x")
    assert engine.get_metrics()["num_running"] == 1 and "x" not in engine.scheduler.requests  # at once
    n_before = len(engine.deltas["x"])
    final = run(engine)
    x_deltas = engine.deltas["x"][n_before:]
    assert len(x_deltas) == 1 and x_deltas[0].finished
    assert [(c.index, c.token_ids, c.finish_reason) for c in x_deltas[0].outputs] == [(0, [], "abort")]
    assert any(x_seq in pl.finished_seq_ids for pl in ex.plans)  # the worker drops its state
    assert final["y"].outputs[0].token_ids == expected(prompt(9, 5), 12)
    assert_idle(engine)


@OVERLAP
def test_each_sample_reports_its_finish_exactly_once(overlap):
    # n=3 seeded samples; a token only one of them produces early ends that one first
    engine, ex = make_engine(async_scheduling=overlap)
    p = prompt(6, 4)
    outs = [expected(p, 10, sample_seed(3, i, 3)) for i in range(3)]
    k = next(i for i in range(3) if any(t not in outs[j][:9] for j in range(3) if j != i for t in outs[i][:2]))
    stop_tok = next(t for t in outs[k][:2] if all(t not in outs[j][:9] for j in range(3) if j != k))
    engine.add_request("n", None, SamplingParams(n=3, seed=3, max_tokens=10, stop_token_ids=[stop_tok]),
                       prompt_token_ids=p)
    final = run(engine)
    finishes = {}
    for d in engine.deltas["n"]:
        for c in d.outputs:
            assert c.index not in finishes, f"sample {c.index} got a delta after its finish"
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    assert finishes[k] == "stop" and all(finishes[j] == "length" for j in range(3) if j != k)
    assert sum(d.finished for d in engine.deltas["n"]) == 1 and engine.deltas["n"][-1].finished
    for o in final["n"].outputs:
        want = outs[o.index]
        assert o.token_ids == (want[:want.index(stop_tok) + 1] if o.index == k else want)
    assert_idle(engine)


def test_a_request_that_can_never_run_is_refused_before_admission():
    engine, ex = make_engine(num_blocks=12, max_num_seqs=4, max_model_len=64)
    free = engine.get_metrics()["num_free_blocks"]
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("big-n", None, SamplingParams(n=5, max_tokens=4), prompt_token_ids=prompt(6))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("long", None, SamplingParams(max_tokens=50), prompt_token_ids=prompt(4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("len", None, SamplingParams(max_tokens=10), prompt_token_ids=prompt(60))
    assert engine.get_metrics()["num_free_blocks"] == free and not engine.has_unfinished_requests()
    engine.add_request("ok", None, SamplingParams(n=4, seed=1, max_tokens=4), prompt_token_ids=prompt(6))
    final = run(engine)
    assert [o.token_ids for o in final["ok"].outputs] == [expected(prompt(6), 4, sample_seed(1, i, 4))
                                                          for i in range(4)]
    assert max(len(pl.seq_ids) for pl in ex.plans) <= 4
    assert_idle(engine)


# -- a bound on the step's time ------------------------------------------------------------------------

FIXED_S, PER_TOKEN_S = 0.005, 0.001     # what TimedExecutor reports a step took


class TimedExecutor(FakeExecutor):
    """``FakeExecutor`` whose steps report a known cost: ``FIXED_S + PER_TOKEN_S`` per token."""

    def execute(self, plan):
        result = super().execute(plan)
        result.forward_time = FIXED_S + PER_TOKEN_S * plan.num_tokens
        return result


@OVERLAP
def test_a_step_time_bound_shrinks_the_chunks_and_changes_no_output(overlap):
    from folio.runtime.scheduler.step_time import MIN_CHUNK_TOKENS

    def serve(max_step_ms):
        config = EngineConfig(block_size=4, async_scheduling=overlap, max_step_ms=max_step_ms)
        ex = TimedExecutor(256, 4)
        engine = RecordingEngine(config, executor=ex, tokenizer=FakeTokenizer())
        for i in range(2):      # two streams decoding
            engine.add_request(f"s{i}", None, SamplingParams(max_tokens=60), prompt_token_ids=prompt(3, i))
        for _ in range(4):
            engine.step()
        engine.add_request("long", None, SamplingParams(max_tokens=4), prompt_token_ids=prompt(200, 9))
        return run(engine), ex

    bounded, ex = serve(40)
    unbounded, ref = serve(None)
    # the same tokens, and those of a plain loop: chunking changes no output
    for rid, p, n in [("s0", prompt(3, 0), 60), ("s1", prompt(3, 1), 60), ("long", prompt(200, 9), 4)]:
        assert bounded[rid].outputs[0].token_ids == unbounded[rid].outputs[0].token_ids == expected(p, n)
    long_seq = 200       # the long prompt's chunks, and the steps that decoded the streams meanwhile

    def chunks(plans):
        out = []
        for plan in plans:
            n = np.diff(plan.query_start_loc)
            if n.max() > 3:    # (the streams' prompts have 3 tokens)
                out.append((int(n.max()), int((n == 1).sum()), FIXED_S + PER_TOKEN_S * plan.num_tokens))
        return out
    got, before = chunks(ex.plans), chunks(ref.plans)
    assert before == [(long_seq, 2, FIXED_S + PER_TOKEN_S * (long_seq + 2))]   # one 207 ms step
    # bounded: a first chunk from the streams' own prefill (its 5 ms of fixed cost counted as its 6
    # tokens': 40 ms fits fewer tokens), then the chunks the measured rate fits into 40 ms beside
    # the two decodes ((40 - 7) ms / 1 ms per token = 33 tokens; with overlap the step after the
    # first is planned before the first's time is known); every step that decoded took <= 40 ms
    first = 2 if overlap else 1
    assert all(MIN_CHUNK_TOKENS <= c < 33 and d == 2 for c, d, _ in got[:first])
    assert [c for c, _, _ in got[first:-1]] == [33] * (len(got) - first - 1) and got[-1][0] <= 33
    assert sum(c for c, _, _ in got) == long_seq
    assert all(t <= 0.040 + 1e-9 for _, d, t in got if d)
