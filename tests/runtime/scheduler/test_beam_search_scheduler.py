"""Beam search and prompt logprobs through the real scheduler, KV cache manager and engine, over a
toy language model (no weights).

The toy worker keeps a simulated KV cache of token ids: it performs the plan's block copies,
writes every input token at its slot and checks that each sequence's context read back through
its block table is exactly that sequence's tokens, so a beam that reads a sibling's block after a
fork (a missed copy-on-write) fails at once. Its next-token logprobs are a fixed pseudo-random
function of the whole context, so an independent beam search over the same function
(tests/support/beam_reference.py) must give exactly the engine's result: same float32 logprobs, same
summation order, no rounding difference.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pytest

from support.beam_reference import reference_beam_search
from folio.runtime.scheduler.beam_search import BeamSearchOutput, beam_score
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.outputs import RequestOutput
from folio.runtime.common.sampling_params import BeamSearchParams, SamplingParams
from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID, StepResult
from support.fake_executor import EOS, FakeTokenizer, RecordingEngine, prompt

V = 50


def toy_logprobs(history) -> np.ndarray:
    """``[V]`` float32 log-softmax of pseudo-random logits seeded by the whole context."""
    key = zlib.crc32(np.asarray(history, dtype=np.int64).tobytes())
    x = np.random.default_rng(key).normal(size=V) * 2.5
    x[EOS] += 3.0   # EOS likely enough that searches end early
    x = x - x.max()
    return (x - np.log(np.exp(x).sum())).astype(np.float32)


class ToyLM:
    """A ``StepRunner`` over ``toy_logprobs`` with a simulated KV cache (module docstring)."""

    def __init__(self, num_blocks, block_size, max_len=512):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.model_config = SimpleNamespace(vocab_size=V, max_position_embeddings=max_len, eos_token_ids=[EOS])
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}    # what each sequence has written / been given
        self.params: dict[int, dict] = {}
        self.last: dict[int, int] = {}
        self.plans = []
        self.fail_next = False

    def execute(self, plan):
        self.plans.append(plan)
        if self.fail_next:
            self.fail_next = False
            return StepResult(plan.step_id, np.zeros(0, np.int64), error="RuntimeError: injected")
        bs = self.block_size
        for sid in plan.finished_seq_ids:
            self.tokens.pop(sid, None)
        for ns in plan.new_seqs:
            self.tokens[ns.seq_id] = list(ns.prompt_token_ids) + list(ns.output_token_ids)
            self.params[ns.seq_id] = ns.sampling
        for src, dst in plan.block_copies:
            self.cache[dst] = self.cache[src]
        ids = np.array(plan.input_ids)
        for i, sid in enumerate(plan.seq_ids.tolist()):
            toks = self.tokens[sid]
            a, b = plan.query_start_loc[i], plan.query_start_loc[i + 1]
            for j, p in zip(range(a, b), plan.positions[a:b].tolist()):
                if ids[j] == PLACEHOLDER_TOKEN_ID:
                    ids[j] = self.last[sid]
                if p < len(toks):
                    assert toks[p] == ids[j], f"seq {sid} input {ids[j]} at {p}, it has {toks[p]}"
                else:
                    assert p == len(toks), f"seq {sid} skips to position {p}"
                    toks.append(int(ids[j]))
        self.cache[plan.slot_mapping // bs, plan.slot_mapping % bs] = ids
        for i, sid in enumerate(plan.seq_ids.tolist()):
            ctx = np.arange(plan.seq_lens[i])
            read = self.cache[plan.block_tables[i][ctx // bs], ctx % bs]
            assert read.tolist() == self.tokens[sid][:plan.seq_lens[i]], f"seq {sid} reads a wrong context"
        rows = [(int(r), int(s)) for r, s in zip(plan.logits_indices, plan.sample_seq_ids)]
        lps = [toy_logprobs(self.tokens[s][:plan.positions[r] + 1]) for r, s in rows]
        out = np.array([int(np.argmax(lp)) for lp in lps], dtype=np.int64)
        for (_, s), t in zip(rows, out.tolist()):
            self.last[s] = t
        res = StepResult(plan.step_id, out)
        want = [self.params[s]["logprobs"] for _, s in rows if self.params[s]["logprobs"] is not None]
        if want:
            K = max(want)
            top = np.array([np.argsort(-lp, kind="stable")[:K] for lp in lps]).reshape(len(rows), K)
            res.logprob_token_ids = np.concatenate([out[:, None], top], axis=1)
            res.logprobs = np.array([lp[ids_] for lp, ids_ in zip(lps, res.logprob_token_ids)], np.float32)
        if len(plan.prompt_logprob_indices):
            owner = np.searchsorted(plan.query_start_loc, plan.prompt_logprob_indices, side="right") - 1
            K = max(self.params[int(plan.seq_ids[o])]["prompt_logprobs"] for o in set(owner.tolist()))
            plp = [toy_logprobs(self.tokens[int(plan.seq_ids[o])][:plan.positions[r] + 1])
                   for r, o in zip(plan.prompt_logprob_indices.tolist(), owner.tolist())]
            tgt = plan.prompt_logprob_token_ids
            top = np.array([np.argsort(-lp, kind="stable")[:K] for lp in plp]).reshape(len(plp), K)
            res.prompt_logprob_token_ids = np.concatenate([tgt[:, None], top], axis=1)
            res.prompt_logprobs = np.array([lp[i] for lp, i in zip(plp, res.prompt_logprob_token_ids)], np.float32)
            res.prompt_logprob_ranks = np.array([int((lp > lp[t]).sum()) + 1 for lp, t in zip(plp, tgt)])
        return res

    def shutdown(self):
        pass


def make_engine(num_blocks=128, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("async_scheduling", False)
    config = EngineConfig(**kw)
    lm = ToyLM(num_blocks, config.block_size)
    return RecordingEngine(config, executor=lm, tokenizer=FakeTokenizer()), lm


def run(engine, on_step=None, max_steps=5000):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        if on_step is not None:
            on_step(engine)
    assert not engine.has_unfinished_requests()
    return {rid: RequestOutput.from_deltas(ds) for rid, ds in engine.deltas.items()}


def assert_idle(engine):
    m = engine.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    assert m["num_running"] == 0 and m["num_waiting"] == 0


def expected(p, params):
    seqs, _ = reference_beam_search(lambda prefixes: [toy_logprobs(x) for x in prefixes], p, params, [EOS])
    return seqs


def assert_beams(out: RequestOutput, want):
    got = BeamSearchOutput.from_request_output(out).sequences
    assert [(s.token_ids, s.finish_reason) for s in got] == [(w[0], w[2]) for w in want]
    # same float32 logprobs summed in the same order: equal to the last bit
    assert [s.cum_logprob for s in got] == [w[1] for w in want]


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


@OVERLAP
@pytest.mark.parametrize("plen", [1, 3, 4, 5, 9])
def test_beam_search_equals_reference_and_frees_every_block(plen, overlap):
    engine, lm = make_engine(async_scheduling=overlap)
    cases = {}
    for width in (1, 2, 3, 4, 8):
        for ignore_eos, include, penalty in ((False, False, 1.0), (True, False, 0.0), (False, True, 2.0)):
            params = BeamSearchParams(beam_width=width, max_tokens=7, ignore_eos=ignore_eos,
                                      include_stop_str_in_output=include, length_penalty=penalty)
            rid = f"w{width}-{ignore_eos}-{include}-{penalty}"
            p = prompt(plen, width)
            engine.add_request(rid, None, params, prompt_token_ids=p)
            cases[rid] = (p, params)
    outs = run(engine)
    for rid, (p, params) in cases.items():
        want = expected(p, params)
        assert_beams(outs[rid], want)
        assert len(engine.deltas[rid]) == 1 and outs[rid].finished  # one delta, at the end
    # EOS finished some results
    assert any(c.finish_reason == "stop" for o in outs.values() for c in o.outputs)
    assert_idle(engine)


def test_text_score_order_and_ignore_eos():
    engine, _ = make_engine()
    params = BeamSearchParams(beam_width=4, max_tokens=6, length_penalty=1.0)
    p = prompt(6, 2)
    engine.add_request("r", None, params, prompt_token_ids=p)
    seqs = BeamSearchOutput.from_request_output(run(engine)["r"]).sequences
    tok = FakeTokenizer()
    assert len(seqs) == 4
    for s in seqs:
        assert s.text == tok.decode(s.token_ids)
        assert EOS not in s.token_ids  # without include_stop_str_in_output
        # the search adds the same float32 logprobs, as Python floats, one step at a time from 0.0:
        # the same additions in the same order give the same float (sum() may compensate: a loop)
        want = 0.0
        for i, t in enumerate(s.token_ids + ([EOS] if s.finish_reason == "stop" else [])):
            want += float(toy_logprobs(p + s.token_ids[:i])[t])
        assert s.cum_logprob == want
    # ranked by cum_logprob / generated length (length_penalty 1; a final EOS is not counted)
    scores = [s.cum_logprob / max(len(s.token_ids), 1) for s in seqs]
    assert scores == sorted(scores, reverse=True)


def test_beam_score_hand_computed():
    assert beam_score(4, -2.0, 1.0) == -0.5
    assert beam_score(4, -2.0, 0.5) == -1.0            # -2 / sqrt(4)
    assert beam_score(4, -2.0, 0.0) == -2.0            # no length penalty: the sum itself
    assert beam_score(0, -3.0, 1.0) == -3.0            # an EOS-first hypothesis: length floored at 1


def test_fork_shares_blocks_copies_the_partial_block_and_frees_pruned_beams():
    engine, lm = make_engine()
    p = prompt(6, 1)   # block 0 full, block 1 half full when the beams fork
    engine.add_request("r", None, BeamSearchParams(beam_width=4, max_tokens=9, ignore_eos=True),
                       prompt_token_ids=p)
    kv = engine.scheduler.kv_cache_manager
    checked = []

    def check(eng):
        req = eng.scheduler.requests.get("r")
        if req is None:
            return
        live = req.beam.live
        held = {b.block_id for s in live for b in kv.seq_blocks.get(s.seq_id, [])}
        m = eng.get_metrics()
        # every block in use belongs to a live beam: a beam that fell off freed its blocks at once
        assert m["num_total_blocks"] - m["num_free_blocks"] == len(held)
        checked.append(len(held))

    engine.step()   # prefill of the one beam
    engine.step()   # the 4 beams decode their first token: forked, the half-full block copied on write
    plan = lm.plans[-1]
    assert np.diff(plan.query_start_loc).tolist() == [1, 1, 1, 1]
    assert len(plan.block_copies) == 3            # three beams copy the shared partial block, one keeps it
    assert len(set(plan.block_tables[:, 0].tolist())) == 1  # the full prompt block stays shared
    run(engine, on_step=check)
    assert checked and max(checked) < 4 * 4       # sharing: fewer blocks than 4 beams x 4 blocks
    assert_idle(engine)


@OVERLAP
@pytest.mark.parametrize("num_blocks", [20, 28])
def test_beams_under_preemption_pressure_equal_ample_memory(num_blocks, overlap):
    # three searches of width 3-4 and two ordinary requests in a pool too small for all of them
    reqs = [("a", prompt(9, 1), BeamSearchParams(beam_width=4, max_tokens=6)),
            ("b", prompt(5, 2), BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)),
            ("c", prompt(13, 3), BeamSearchParams(beam_width=4, max_tokens=5, include_stop_str_in_output=True))]
    plain = [("x", prompt(7, 4), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)),
             ("y", prompt(3, 5), SamplingParams(n=2, max_tokens=9, temperature=0.0, ignore_eos=True))]
    results = []
    for blocks in (num_blocks, 512):
        engine, _ = make_engine(num_blocks=blocks, async_scheduling=overlap, max_num_batched_tokens=16)
        for rid, p, params in reqs + plain:
            engine.add_request(rid, None, params, prompt_token_ids=p)
        results.append((run(engine), engine.get_metrics()))
        assert_idle(engine)
    (small, m_small), (ample, m_ample) = results
    assert m_small["num_preemptions"] > 0 and m_ample["num_preemptions"] == 0
    for rid, p, params in reqs:
        assert_beams(small[rid], expected(p, params))
        assert_beams(ample[rid], expected(p, params))
    for rid, _, _ in plain:
        assert [c.token_ids for c in small[rid].outputs] == [c.token_ids for c in ample[rid].outputs]


def test_two_searches_that_only_fit_one_at_a_time():
    # each search alone needs 3 beams x 4 blocks = 12 of the 16 blocks unshared: while one holds
    # its blocks the other must wait, and neither may hold half of its beams forever
    engine, _ = make_engine(num_blocks=16)
    reqs = [(r, prompt(11, i), BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True))
            for i, r in enumerate("ab")]
    for rid, p, params in reqs:
        engine.add_request(rid, None, params, prompt_token_ids=p)
    outs = run(engine)
    for rid, p, params in reqs:
        assert_beams(outs[rid], expected(p, params))
    assert_idle(engine)


def test_abort_max_tokens_zero_validation():
    engine, lm = make_engine(num_blocks=32, max_num_seqs=8)
    with pytest.raises(ValueError, match="beam_width"):
        engine.add_request("w", None, BeamSearchParams(beam_width=9, max_tokens=2), prompt_token_ids=[1, 2])
    with pytest.raises(ValueError, match="nothing shared"):   # 8 beams x 5 blocks > 32
        engine.add_request("b", None, BeamSearchParams(beam_width=8, max_tokens=10), prompt_token_ids=prompt(10))
    engine.add_request("z", None, BeamSearchParams(beam_width=3, max_tokens=0), prompt_token_ids=[1, 2, 3])
    engine.add_request("a", None, BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True),
                       prompt_token_ids=prompt(5))
    engine.step()
    engine.step()
    engine.abort_request("a")
    outs = run(engine)
    z = BeamSearchOutput.from_request_output(outs["z"]).sequences
    assert [(s.token_ids, s.cum_logprob, s.finish_reason) for s in z] == [([], 0.0, "length")]
    assert {c.finish_reason for c in outs["a"].outputs} == {"abort"}
    assert_idle(engine)


@OVERLAP
def test_failed_step_recovers_beams(overlap):
    engine, lm = make_engine(async_scheduling=overlap)
    p = prompt(7, 3)
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    engine.add_request("r", None, params, prompt_token_ids=p)
    for _ in range(3):
        engine.step()
    lm.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(5):
            engine.step()
    assert_beams(run(engine)["r"], expected(p, params))
    assert_idle(engine)


# -- prompt logprobs -------------------------------------------------------------------------------

def assert_prompt_logprobs(out: RequestOutput, p, k):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        lp = toy_logprobs(p[:i])
        entry = plp[i]
        assert entry[p[i]].logprob == float(lp[p[i]])
        assert entry[p[i]].rank == int((lp > lp[p[i]]).sum()) + 1
        top = np.argsort(-lp, kind="stable")[:k].tolist()
        assert set(entry) == set(top) | {p[i]}
        for j, t in enumerate(top):
            if t != p[i]:
                assert entry[t].logprob == float(lp[t]) and entry[t].rank == j + 1


@OVERLAP
@pytest.mark.parametrize("budget", [5, 64])
def test_prompt_logprobs_chunked_forked_and_preempted(budget, overlap):
    engine, _ = make_engine(num_blocks=10, async_scheduling=overlap, max_num_batched_tokens=budget)
    cases = [("a", prompt(17, 1), SamplingParams(prompt_logprobs=3, max_tokens=4, temperature=0.0, ignore_eos=True)),
             ("n", prompt(9, 2), SamplingParams(n=3, prompt_logprobs=0, max_tokens=3, temperature=0.0,
                                                 ignore_eos=True)),
             ("one", [5], SamplingParams(prompt_logprobs=2, max_tokens=1)),
             ("plain", prompt(12, 3), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
    for rid, p, sp in cases:
        engine.add_request(rid, None, sp, prompt_token_ids=p)
    outs = run(engine)
    for rid, p, sp in cases:
        if sp.prompt_logprobs is None:
            assert outs[rid].prompt_logprobs is None
        else:
            assert_prompt_logprobs(outs[rid], p, sp.prompt_logprobs)
            assert sum(d.prompt_logprobs is not None for d in engine.deltas[rid]) == 1
    assert_idle(engine)


def test_prompt_logprobs_skip_the_prefix_cache_read():
    engine, _ = make_engine()
    p = prompt(14, 7)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.add_request("warm", None, greedy, prompt_token_ids=p)
    run(engine)
    engine.add_request("hit", None, greedy, prompt_token_ids=p)
    engine.add_request("lp", None, greedy.clone(prompt_logprobs=1), prompt_token_ids=p)
    outs = run(engine)
    assert outs["hit"].num_cached_tokens == 12      # three full blocks of 4
    assert outs["lp"].num_cached_tokens == 0        # computed again: every position has its logits
    assert_prompt_logprobs(outs["lp"], p, 1)
    assert outs["lp"].outputs[0].token_ids == outs["hit"].outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("z", None, greedy.clone(prompt_logprobs=1, max_tokens=0), prompt_token_ids=p)
    assert_idle(engine)


@OVERLAP
def test_prompt_logprobs_after_a_failed_step(overlap):
    engine, lm = make_engine(async_scheduling=overlap, max_num_batched_tokens=4)
    p = prompt(15, 4)
    engine.add_request("r", None, SamplingParams(prompt_logprobs=2, max_tokens=2), prompt_token_ids=p)
    engine.step()
    lm.fail_next = True
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(4):
            engine.step()
    assert_prompt_logprobs(run(engine)["r"], p, 2)
    assert_idle(engine)


def test_split_searches_holding_memory_are_released(monkeypatch):
    # Two searches each split in two (one beam running, one preempted) in a pool where neither
    # preempted beam fits while the running halves hold their blocks: nothing can run until the
    # scheduler preempts an idle half (Scheduler._preempt_idle_beams)
    engine, _ = make_engine(num_blocks=12, max_num_batched_tokens=64, enable_prefix_caching=False)
    sched = engine.scheduler
    released = []
    real = type(sched)._preempt_idle_beams

    def spy(self, out):
        n = out.num_preempted
        real(self, out)
        released.append(out.num_preempted - n)

    monkeypatch.setattr(type(sched), "_preempt_idle_beams", spy)
    reqs = [(r, prompt(15, i), BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)) for i, r in enumerate("ab")]
    for rid, p, params in reqs:
        engine.add_request(rid, None, params, prompt_token_ids=p)
    for _ in range(50):   # until both searches run two beams each, none waiting for a result
        engine.step()
        live = [s for rid, _, _ in reqs for s in sched.requests[rid].beam.live]
        if len(live) == 4 and all(s.status.value == "running" and not s.num_output_placeholders for s in live) \
                and all(not sched.requests[rid].beam.pending for rid, _, _ in reqs):
            break
    else:
        pytest.fail("the two searches never ran side by side")
    for rid, _, _ in reqs:
        sched.preempt(sched.requests[rid].beam.live[1])
    outs = run(engine)
    assert any(released), "the stuck state did not arise"
    for rid, p, params in reqs:
        assert_beams(outs[rid], expected(p, params))
    assert_idle(engine)
