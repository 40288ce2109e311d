"""The engine (scheduler, KV cache manager, block pool, output processor) driven through random
sequences of operations by a Hypothesis state machine, over a toy worker and a tiny block pool.

Operations: add a request (plain or seeded sampling, ``n > 1`` samples forked after the prefill, a
beam search, with logprobs or not; prompts drawn from a few shared prefixes so that later requests
hit the prefix cache, some with a cache salt), abort one, and step. The pool holds 10 to 16 blocks
of 4 tokens, so requests preempt one another (recomputed later), and the step's token budget is
drawn too (prefills in chunks); half the machines overlap scheduling with the worker.

The toy worker keeps a simulated KV cache of token ids: it performs the plan's block copies,
writes every input token at its slot, and checks that each sequence reads back exactly its own
context through its block table (a missed copy-on-write after a fork, a prefix hit on a stale
block, a slot given twice all fail there). It samples ``next_token(context, seed)``
(``support.fake_executor``: a fixed function of the whole context, never EOS) and reports the
logprobs of ``toy_logprobs(context)`` (a fixed pseudo-random log-softmax), so any schedule must
give what the same request gives alone.

Invariants, after every operation: each block's reference count equals the number of sequences
holding it, a block is in the free queue exactly when that count is 0 (so none is leaked or
freed twice), free + used = the pool, and every sequence holding blocks belongs to a live request.
At the end of each run (all steps drained): every request finished, with ``"abort"`` for the
samples of an aborted one that had not ended; the pool is whole again; and each request that was
not aborted has the output of the same request run alone (a fresh engine with a large pool), an
aborted one a prefix of it.

The default run tries a few dozen machines (a few seconds); ``-m slow`` runs many more.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test
from support.fake_executor import EOS, V, FakeTokenizer, RecordingEngine, next_token, prompt

from folio.runtime.common.config import EngineConfig, cdiv
from folio.runtime.common.outputs import RequestOutput
from folio.runtime.common.sampling_params import BeamSearchParams, SamplingParams
from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID, StepResult

BS = 4
MAX_LEN = 256
PREFIXES = [prompt(12, 0), prompt(12, 5), [3] * 12]


def toy_logprobs(context) -> np.ndarray:
    """``[V]`` float32 log-softmax of pseudo-random logits seeded by the whole context."""
    x = np.random.default_rng(zlib.crc32(np.asarray(context, np.int64).tobytes())).normal(size=V) * 2.0
    x[EOS] += 2.0  # EOS among the top candidates often enough that beams end early
    x -= x.max()
    return (x - np.log(np.exp(x).sum())).astype(np.float32)


class ToyWorker:
    """A ``StepRunner`` over a simulated KV cache (module docstring)."""

    def __init__(self, num_blocks):
        self.num_blocks, self.block_size = num_blocks, BS
        self.model_config = SimpleNamespace(vocab_size=V, max_position_embeddings=MAX_LEN, eos_token_ids=[EOS])
        self.cache = np.full((num_blocks, BS), -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}   # per sequence: the tokens it was given or fed
        self.seeds: dict[int, int | None] = {}
        self.k: dict[int, int | None] = {}       # per sequence: how many top logprobs it asks for
        self.last: dict[int, int] = {}           # per sequence: the token sampled last

    def execute(self, plan):
        for sid in plan.finished_seq_ids:
            self.tokens.pop(sid, None)
        for ns in plan.new_seqs:
            assert ns.seq_id not in self.tokens, f"seq {ns.seq_id} introduced twice"
            self.tokens[ns.seq_id] = list(ns.prompt_token_ids) + list(ns.output_token_ids)
            self.seeds[ns.seq_id] = ns.seed
            self.k[ns.seq_id] = ns.sampling.get("logprobs")
        for src, dst in plan.block_copies:
            self.cache[dst] = self.cache[src]
        assert plan.slot_mapping.min() >= 0
        assert len(set(plan.slot_mapping.tolist())) == len(plan.slot_mapping), "two tokens, one slot"
        ids = np.array(plan.input_ids)
        for i, sid in enumerate(plan.seq_ids.tolist()):
            toks = self.tokens[sid]
            a, b = plan.query_start_loc[i], plan.query_start_loc[i + 1]
            for j, p in zip(range(a, b), plan.positions[a:b].tolist()):
                if ids[j] == PLACEHOLDER_TOKEN_ID:   # overlap: the token this sequence sampled last
                    assert j == b - 1, "a placeholder that is not the last input"
                    ids[j] = self.last[sid]
                if p < len(toks):
                    assert toks[p] == ids[j], f"seq {sid}: input {ids[j]} at {p}, it has {toks[p]}"
                else:
                    assert p == len(toks), f"seq {sid} skips to position {p}"
                    toks.append(int(ids[j]))
        self.cache[plan.slot_mapping // BS, plan.slot_mapping % BS] = ids
        for i, sid in enumerate(plan.seq_ids.tolist()):
            ctx = np.arange(plan.seq_lens[i])
            read = self.cache[plan.block_tables[i][ctx // BS], ctx % BS]
            assert read.tolist() == self.tokens[sid][:plan.seq_lens[i]], f"seq {sid} reads a wrong context"
        rows = [(int(r), int(s)) for r, s in zip(plan.logits_indices, plan.sample_seq_ids)]
        contexts = [self.tokens[s][:plan.positions[r] + 1] for r, s in rows]
        out = np.array([next_token(c, self.seeds[s]) for c, (_, s) in zip(contexts, rows)], np.int64)
        for (_, s), t in zip(rows, out.tolist()):
            self.last[s] = t
        res = StepResult(plan.step_id, out)
        want = [self.k[s] for _, s in rows if self.k[s] is not None]
        if want:
            K = max(want)
            lps = [toy_logprobs(c) for c in contexts]
            top = np.array([np.argsort(-lp, kind="stable")[:K] for lp in lps]).reshape(len(rows), K)
            res.logprob_token_ids = np.concatenate([out[:, None], top], axis=1)
            res.logprobs = np.array([lp[i] for lp, i in zip(lps, res.logprob_token_ids)], np.float32)
        return res

    def shutdown(self):
        pass


def make_engine(num_blocks, budget, overlap):
    config = EngineConfig(block_size=BS, max_num_seqs=8, max_num_batched_tokens=budget, async_scheduling=overlap)
    return RecordingEngine(config, executor=ToyWorker(num_blocks), tokenizer=FakeTokenizer())


def drain(engine, max_steps=5000):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError(f"not idle after {max_steps} steps")


def summary(out: RequestOutput):
    return [(c.index, c.token_ids, c.finish_reason, c.text, c.cumulative_logprob) for c in out.outputs]


_ALONE: dict = {}


def alone(prompt_ids, params, salt):
    """The request's output in a fresh engine of its own with a large pool (cached per request)."""
    key = (tuple(prompt_ids), repr(params), salt)
    if key not in _ALONE:
        engine = make_engine(64, 64, False)
        engine.add_request("alone", None, params, prompt_token_ids=list(prompt_ids), cache_salt=salt)
        drain(engine)
        _ALONE[key] = summary(engine.final("alone"))
        engine.shutdown()
    return _ALONE[key]


KINDS = st.sampled_from(["greedy", "seeded", "n", "beam", "logprobs"])


class EngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(10, 16), budget=st.sampled_from([5, 8, 16, 64]), overlap=st.booleans())
    def start(self, num_blocks, budget, overlap):
        self.engine = make_engine(num_blocks, budget, overlap)
        self.num_blocks = num_blocks
        self.requests: dict[str, tuple] = {}   # id -> (prompt, params, salt)
        self.aborted: set[str] = set()

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        try:
            drain(engine)
            self.check_pool()
            m = engine.get_metrics()   # what the run went through (pytest --hypothesis-show-statistics)
            event(f"preempted: {m['num_preemptions'] > 0}")
            event(f"prefix hits: {m['prefix_cache_hits'] > 0}")
            event(f"aborted: {bool(self.aborted)}")
            kinds = {type(p).__name__ if isinstance(p, BeamSearchParams) else f"n={p.n}"
                     for _, p, _ in self.requests.values()}
            event(f"beam search: {'BeamSearchParams' in kinds}; n > 1: {any(k in kinds for k in ('n=2', 'n=3'))}")
            kv = engine.scheduler.kv_cache_manager
            assert not kv.seq_blocks and kv.get_num_free_blocks() == self.num_blocks, "blocks left held"
            assert not engine.scheduler.requests
            for rid, (p, params, salt) in self.requests.items():
                deltas = engine.deltas.get(rid)
                assert deltas and deltas[-1].finished, f"request {rid} never finished"
                got = summary(RequestOutput.from_deltas(deltas))
                want = alone(p, params, salt)
                if rid not in self.aborted:
                    assert got == want, (rid, params, got, want)
                elif not isinstance(params, BeamSearchParams):
                    # each sample: a prefix of its run alone, ended by abort unless it had ended
                    want = {w[0]: w for w in want}
                    for index, toks, reason, _, _ in got:
                        w = want[index]
                        assert toks == w[1][:len(toks)], (rid, index, toks, w)
                        assert reason == "abort" or (reason, toks) == (w[2], w[1]), (rid, reason, w)
                else:
                    assert all(c[2] is not None for c in got), (rid, got)
        finally:
            engine.shutdown()

    def _add(self, p, kind, max_tokens, n, width, seed, salt):
        if kind == "beam":
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
        else:
            params = SamplingParams(temperature=0.0 if kind == "greedy" else 1.0,
                                    seed=None if kind == "greedy" else seed, n=n if kind == "n" else 1,
                                    max_tokens=max_tokens, logprobs=2 if kind == "logprobs" else None)
        rid = f"r{len(self.requests)}"
        need = cdiv(len(p) + max_tokens, BS)
        beams = width if kind == "beam" else 1
        if beams * need > self.num_blocks:   # the engine's own rule: it could never fit the cache
            with pytest.raises(ValueError, match="KV blocks"):
                self.engine.add_request(rid, None, params, prompt_token_ids=p, cache_salt=salt)
            return
        self.engine.add_request(rid, None, params, prompt_token_ids=p, cache_salt=salt)
        self.requests[rid] = (p, params, salt)

    @rule(kind=KINDS, which=st.integers(0, len(PREFIXES) - 1), keep=st.integers(1, 12),
          tail=st.lists(st.integers(1, V - 1), max_size=4), max_tokens=st.integers(1, 16),
          n=st.integers(2, 3), width=st.integers(2, 3), seed=st.integers(0, 3), salted=st.booleans(),
          copies=st.integers(1, 3))
    def add(self, kind, which, keep, tail, max_tokens, n, width, seed, salted, copies):
        for _ in range(copies):   # copies arrive together: they contend for blocks and share a prefix
            self._add(PREFIXES[which][:keep] + tail, kind, max_tokens, n, width, seed, "s" if salted else None)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 10_000), kind=KINDS, extra=st.lists(st.integers(1, V - 1), max_size=3),
          max_tokens=st.integers(1, 16), n=st.integers(2, 3), width=st.integers(2, 3), seed=st.integers(0, 3))
    def add_same_prompt(self, pick, kind, extra, max_tokens, n, width, seed):
        # an earlier request's prompt (and salt), perhaps extended: its full blocks are prefix hits
        # while they are held or cached-free
        p, _, salt = self.requests[sorted(self.requests)[pick % len(self.requests)]]
        self._add(p + extra, kind, max_tokens, n, width, seed, salt)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 10_000))
    def abort(self, pick):
        rid = sorted(self.requests)[pick % len(self.requests)]
        if rid in self.engine.scheduler.requests:  # still running: the abort ends it
            self.aborted.add(rid)
        self.engine.abort_request(rid)

    @rule()
    def step(self):
        self.engine.step()

    @rule(steps=st.integers(2, 5))
    def steps(self, steps):
        for _ in range(steps):
            self.engine.step()
            self.check_pool()

    @invariant()
    def check_pool(self):
        sched = self.engine.scheduler
        kv = sched.kv_cache_manager
        pool = kv.pool
        holders: dict[int, int] = {}
        for blocks in kv.seq_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks), "a sequence holds a block twice"
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        free = {b.block_id for b in pool.free_block_queue}
        assert len(free) == pool.get_num_free_blocks(), "a block is in the free queue twice"
        for block in pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0), (block.block_id, block.ref_cnt, holders)
            assert (block.block_id in free) == (block.ref_cnt == 0), block.block_id
        assert pool.get_num_free_blocks() + len(holders) == pool.num_blocks
        live = {s.seq_id: s for s in list(sched.running) + list(sched.waiting)}
        for sid in kv.seq_blocks:
            assert sid in live, f"seq {sid} holds blocks but is neither running nor waiting"
            rid = live[sid].request.request_id
            assert rid in sched.requests and rid not in self.aborted, f"seq {sid} of ended request {rid} holds blocks"


_FAST = settings(max_examples=40, stateful_step_count=50, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_SLOW = settings(max_examples=600, stateful_step_count=60, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def test_engine_state_machine():
    run_state_machine_as_test(EngineMachine, settings=_FAST)


@pytest.mark.slow
def test_engine_state_machine_many_examples():
    run_state_machine_as_test(EngineMachine, settings=_SLOW)
