"""Speculative decoding on the scheduler side, with a fake worker (no model).

The worker (``support.spec_fake_runner``) keeps a simulated KV cache of token ids and a target
whose greedy next token is a fixed function of the history, mostly predictable by n-gram lookup
and sometimes not, so steps mix accepted and rejected drafts. The independent expectations: the
outputs of a plain one-token-at-a-time loop (``expected_tokens``); every context the worker reads
back through a block table is the sequence's own tokens; after any mix of accepts and rejects the
free blocks return to the idle count; every block in the prefix cache holds exactly the tokens
its hash stands for, so no rejected draft is ever a prefix-cache hit.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from folio.runtime.common.config import EngineConfig, SpeculativeConfig
from folio.runtime.common.outputs import RequestOutput
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.scheduler.engine import LLMEngine
from folio.runtime.scheduler.kv_cache_utils import extend_block_hashes
from folio.runtime.scheduler.ngram_proposer import NgramProposer, TokenHistory
from folio.runtime.worker.spec_decode import accept_greedy, verify_rows

from support.spec_fake_runner import V, FakeTokenizer, SpecFakeExecutor, expected_tokens, target_token

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
         "disable_by_batch_size": 64}
OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])


# -- the n-gram proposer against a brute-force reading of its rule ----------------------------------
def reference_proposal(tokens, min_n, max_n, k):
    """The longest n in [min_n, max_n] whose last-n tokens occur earlier (ending before the last
    position), the earliest such occurrence, and the up to k tokens after it: a direct loop."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for start in range(0, L - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_proposer_matches_the_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    for trial in range(3000):
        L = int(rng.integers(1, 40))
        vocab = int(rng.integers(2, 6))
        tokens = rng.integers(0, vocab, L).tolist()
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 6))
        got = NgramProposer(min_n, max_n, k).propose(np.array(tokens, dtype=np.int64))
        assert got == reference_proposal(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_ngram_proposer_examples():
    p = NgramProposer(2, 3, 2)
    # longest first: [3, 4] recurs at 2..3 (-> 5, 6); the 3-gram [2, 3, 4] recurs at 1..3
    assert p.propose(np.array([1, 2, 3, 4, 5, 6, 9, 2, 3, 4])) == [5, 6]
    # earliest of equal matches; the proposal stops at the end of the known tokens
    assert p.propose(np.array([7, 8, 1, 7, 8, 2, 7, 8])) == [1, 7]
    assert p.propose(np.array([5, 6, 5, 6])) == [5, 6]          # overlapping its own suffix
    assert p.propose(np.array([1, 2, 3, 4])) == []               # nothing recurs
    assert p.propose(np.array([1, 2, 3, 1, 9])) == []            # a 1-gram only, below the minimum
    assert NgramProposer(1, 3, 4).propose(np.array([4, 1, 2, 3, 4]), k=2) == [1, 2]   # the caller's limit


def test_may_propose_after_is_exact_for_every_next_token():
    """``may_propose_after(t)`` is false only if ``t`` + any one token has no proposal."""
    rng = np.random.default_rng(2)
    for trial in range(400):
        vocab = int(rng.integers(2, 5))
        tokens = rng.integers(0, vocab, int(rng.integers(1, 25))).tolist()
        min_n = int(rng.integers(1, 4))
        p = NgramProposer(min_n, min_n + 2, 3)
        some = any(reference_proposal(tokens + [t], min_n, min_n + 2, 3) for t in range(vocab))
        if not p.may_propose_after(np.array(tokens, dtype=np.int64)):
            assert not some, (tokens, min_n)


def test_token_history_grows_with_the_sequence():
    h = TokenHistory()
    ids = list(range(5))
    assert h.sync(ids).tolist() == ids
    ids += list(range(100, 300))
    assert h.sync(ids).tolist() == ids


# -- the speculative config --------------------------------------------------------------------------
def test_speculative_config_takes_vllms_json_shape():
    c = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    assert isinstance(c.speculative_config, SpeculativeConfig)
    assert (c.speculative_config.num_speculative_tokens, c.speculative_config.prompt_lookup_max,
            c.speculative_config.prompt_lookup_min) == (2, 4, 4)   # vLLM: one given, both take it
    assert EngineConfig().speculative_config is None
    from dataclasses import asdict
    again = EngineConfig(**asdict(c))  # the worker process's init message carries it as a dict
    assert again.speculative_config == c.speculative_config


@pytest.mark.parametrize("bad, word", [
    ('{"method": "eagle"}', "method"), ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"), ('{"k": 3}', "unknown"),
    ("[1]", "object"), ("{", "JSON")])
def test_speculative_config_rejects_bad_values(bad, word):
    with pytest.raises(ValueError, match=word):
        EngineConfig(speculative_config=bad)


# -- the worker's greedy verification against a loop --------------------------------------------------
def test_accept_greedy_is_the_longest_agreeing_prefix():
    rng = np.random.default_rng(1)
    for trial in range(500):
        R = int(rng.integers(1, 6))
        nd = rng.integers(0, 5, R)
        sizes = rng.integers(1, 4, R) + nd   # each sequence's chunk: other tokens, then its drafts
        starts_tok = np.concatenate([[0], np.cumsum(sizes)])
        li = starts_tok[1:] - 1
        input_ids = rng.integers(0, 3, int(starts_tok[-1]))
        rows, starts = verify_rows(li, nd)
        targets = rng.integers(0, 3, len(rows))
        acc, last, emitted = accept_greedy(targets, input_ids, rows, starts)
        want_emitted = []
        for i in range(R):
            blk = list(range(li[i] - nd[i], li[i] + 1))
            assert rows[starts[i]:starts[i + 1]].tolist() == blk
            a = 0
            while a < nd[i] and input_ids[blk[a] + 1] == targets[starts[i] + a]:
                a += 1
            assert acc[i] == a and last[i] == targets[starts[i] + a]
            want_emitted += list(range(starts[i], starts[i] + a + 1))
        assert emitted.tolist() == want_emitted


# -- the engine over the fake worker ------------------------------------------------------------------
class Recording(LLMEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.deltas: dict[str, list] = {}
        self.prompts: dict[str, list[int]] = {}
        self.request_of_seq: dict[int, str] = {}

    def add_request(self, request_id, prompt, sampling_params=None, prompt_token_ids=None, **kw):
        self.prompts[request_id] = list(prompt_token_ids)
        super().add_request(request_id, prompt, sampling_params, prompt_token_ids=prompt_token_ids, **kw)

    def step(self, block=True):
        out = super().step(block)
        for d in out:
            self.deltas.setdefault(d.request_id, []).append(d)
        kv = self.scheduler.kv_cache_manager
        for seq in self.scheduler.running:
            self.request_of_seq[seq.seq_id] = seq.request.request_id
            if not self._in_flight:  # nothing in flight: a sequence holds only its computed tokens' blocks
                held = len(kv.get_block_ids(seq))
                assert held == -(-seq.num_computed_tokens // self.config.block_size), \
                    f"{seq} holds {held} blocks"
        return out

    def tokens_of_hash(self) -> dict:
        """Every full block of every finished request's accepted tokens (prompt and output), by
        its prefix-cache hash."""
        bs = self.config.block_size
        out = {}
        for rid, ds in self.deltas.items():
            r = RequestOutput.from_deltas(ds)
            for c in r.outputs:
                tokens = self.prompts[rid] + list(c.token_ids)
                for i, h in enumerate(extend_block_hashes([], tokens, bs, None)):
                    out[h] = tokens[i * bs:(i + 1) * bs]
        return out


def make_engine(num_blocks=128, spec=NGRAM, target=target_token, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("async_scheduling", False)
    config = EngineConfig(speculative_config=spec, **kw)
    ex = SpecFakeExecutor(num_blocks, config.block_size, target=target)
    return Recording(config, executor=ex, tokenizer=FakeTokenizer()), ex


def run(engine, max_steps=20_000):
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    return {rid: RequestOutput.from_deltas(ds) for rid, ds in engine.deltas.items()}


def prompt(n, salt=0):
    return [(i * 7 + salt) % (V - 1) + 1 for i in range(n)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_idle_and_cache_consistent(engine, ex):
    m = engine.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"], "blocks leaked"
    assert m["num_running"] == 0 and m["num_waiting"] == 0
    bs = engine.config.block_size
    registered = [b for b in engine.scheduler.kv_cache_manager.pool.blocks if b.block_hash is not None]
    tokens_of = engine.tokens_of_hash()
    for b in registered:
        assert b.block_hash in tokens_of, "a registered block is no block of accepted tokens"
        assert ex.cache[b.block_id].tolist() == tokens_of[b.block_hash], \
            "a prefix-cache block holds other tokens than its hash says"
    return len(registered)


def spec_counts(engine):
    m = engine.get_metrics()
    return m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]


@OVERLAP
def test_greedy_outputs_equal_one_token_at_a_time_and_blocks_return(overlap):
    engine, ex = make_engine(async_scheduling=overlap)
    cases = [(prompt(n, salt), mt) for (n, salt), mt in zip(itertools.product([1, 3, 9, 17], [0, 5]),
                                                            itertools.cycle([1, 2, 7, 40, 61]))]
    for i, (p, mt) in enumerate(cases):
        engine.add_request(f"r{i}", None, greedy(mt), prompt_token_ids=p)
    outs = run(engine)
    for i, (p, mt) in enumerate(cases):
        assert outs[f"r{i}"].outputs[0].token_ids == expected_tokens(p, mt), f"r{i}"
    drafted, accepted = spec_counts(engine)
    assert 0 < accepted < drafted, "the run should mix accepted and rejected drafts"
    assert any(len(p.num_draft_tokens) and p.num_draft_tokens.max() > 0 for p in ex.plans)
    # the counters against the plans and the worker's answers
    m = engine.get_metrics()
    rows = [(int(d), int(a)) for p, a in zip(ex.plans, ex.accepted) for d, a in zip(p.num_draft_tokens, a) if d]
    assert m["spec_decode_num_drafts"] == len(rows) and drafted == sum(d for d, _ in rows)
    assert accepted == sum(a for _, a in rows)
    per_pos = m["spec_decode_num_accepted_tokens_per_pos"]
    assert per_pos == [sum(a > i for _, a in rows) for i in range(3)]
    assert m["spec_decode_acceptance_rate"] == accepted / drafted
    assert m["spec_decode_mean_acceptance_length"] == 1 + accepted / len(rows)
    assert_idle_and_cache_consistent(engine, ex)


@OVERLAP
@pytest.mark.parametrize("num_blocks", [11, 16])
def test_tiny_pool_preempts_and_keeps_outputs(num_blocks, overlap):
    engine, ex = make_engine(num_blocks=num_blocks, async_scheduling=overlap)
    cases = [(prompt(5 + i, i), 14 + 3 * i) for i in range(6)]
    for i, (p, mt) in enumerate(cases):
        engine.add_request(f"r{i}", None, greedy(mt), prompt_token_ids=p)
    outs = run(engine)
    assert engine.get_metrics()["num_preemptions"] > 0
    for i, (p, mt) in enumerate(cases):
        assert outs[f"r{i}"].outputs[0].token_ids == expected_tokens(p, mt)
    assert_idle_and_cache_consistent(engine, ex)


@OVERLAP
def test_prefix_cache_hits_only_accepted_tokens(overlap):
    """A second round of prompts that follow the drafts the first round rejected (each first-round
    sequence's tokens up to a verifying step, then all the drafts it verified there), and prompts
    that extend whole first-round sequences. A hit may only cover full blocks of tokens some
    first-round sequence accepted (the longest common prefix with one of them), the fake worker
    checks every context it reads, and the outputs stay exact."""
    engine, ex = make_engine(async_scheduling=overlap)
    first = [prompt(6 + i, i) for i in range(4)]
    for i, p in enumerate(first):
        engine.add_request(f"a{i}", None, greedy(30), prompt_token_ids=p)
    outs = run(engine)
    assert_idle_and_cache_consistent(engine, ex)
    full = {f"a{i}": p + outs[f"a{i}"].outputs[0].token_ids for i, p in enumerate(first)}
    second = [seq + [3, 1] for seq in full.values()]
    for plan in ex.plans:
        for r, sid in enumerate(plan.sample_seq_ids.tolist()):
            if len(plan.num_draft_tokens) and plan.num_draft_tokens[r]:
                li, d = int(plan.logits_indices[r]), int(plan.num_draft_tokens[r])
                pos = int(plan.positions[li - d])
                seq = full[engine.request_of_seq[sid]]
                path = seq[:pos + 1] + plan.input_ids[li - d + 1:li + 1].tolist()
                if path != seq[:len(path)]:
                    second.append(path + [2])
    assert len(second) > len(first), "some drafts should have been rejected"
    for i, p in enumerate(second):
        engine.add_request(f"b{i}", None, greedy(12), prompt_token_ids=p)
    outs2 = run(engine)
    bs = engine.config.block_size
    for i, p in enumerate(second):
        out = outs2[f"b{i}"]
        assert out.outputs[0].token_ids == expected_tokens(p, 12)
        lcp = max(next((j for j, (x, y) in enumerate(zip(p, seq)) if x != y), min(len(p), len(seq)))
                  for seq in full.values())
        assert out.num_cached_tokens <= min(lcp, len(p) - 1) // bs * bs, f"b{i} hit tokens nobody accepted"
    assert sum(o.num_cached_tokens for o in outs2.values()) > 0
    assert_idle_and_cache_consistent(engine, ex)


def expected_with_stops(p, max_tokens, stop_ids):
    out = []
    for t in expected_tokens(p, max_tokens):
        out.append(t)
        if t in stop_ids:
            break
    return out


@OVERLAP
def test_n_samples_stop_tokens_and_aborts(overlap):
    engine, ex = make_engine(async_scheduling=overlap)
    p0, p1 = prompt(8, 1), prompt(12, 2)
    stop = expected_tokens(p1, 40)[17]   # a token that comes in the middle of the output
    engine.add_request("n", None, greedy(25, n=3), prompt_token_ids=p0)
    engine.add_request("s", None, greedy(40, stop_token_ids=[stop]), prompt_token_ids=p1)
    engine.add_request("x", None, greedy(60), prompt_token_ids=prompt(9, 3))
    for _ in range(4):
        engine.step()
    engine.abort_request("x")
    outs = run(engine)
    assert [c.token_ids for c in outs["n"].outputs] == [expected_tokens(p0, 25)] * 3
    s = outs["s"].outputs[0]
    assert s.token_ids == expected_with_stops(p1, 40, {stop}) and s.finish_reason == "stop" and s.stop_reason == stop
    assert outs["x"].outputs[0].finish_reason == "abort"
    assert_idle_and_cache_consistent(engine, ex)


def test_stop_strings_found_inside_a_step_drop_the_tokens_after_them():
    """Stop strings that end at a token in the middle of a step's accepted tokens (found from a
    run without them: a token that came with others after it in one delta): the output is cut
    there, tokens after it dropped, exactly as without speculation, in both scheduling modes."""
    prompts = [[(3 * i + 1) % 7 + 1 for i in range(n)] + prompt(5, n) for n in (7, 9, 12, 15)]
    engine, ex = make_engine()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, greedy(40), prompt_token_ids=p)
    run(engine)
    stops = []
    for i, p in enumerate(prompts):
        text = FakeTokenizer().decode(expected_tokens(p, 40))   # one character per token
        pos, inside = 0, []
        for d in engine.deltas[f"r{i}"]:
            n = len(d.outputs[0].token_ids) if d.outputs else 0
            inside += list(range(pos, pos + n - 1))   # not the step's last token
            pos += n
        j = next((j for j in inside if j >= 1 and text.find(text[j - 1:j + 1]) == j - 1), None)
        if j is not None:
            stops.append((i, text[j - 1:j + 1], j))
    assert len(stops) >= 2, "the run should have steps of several tokens"
    results = []
    for spec, overlap in ((NGRAM, False), (NGRAM, True), (None, False)):
        engine, ex = make_engine(spec=spec, async_scheduling=overlap)
        for i, stop, j in stops:
            engine.add_request(f"r{i}", None, greedy(40, stop=[stop, "zz"], include_stop_str_in_output=bool(i % 2)),
                               prompt_token_ids=prompts[i])
        outs = run(engine)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                         o.outputs[0].stop_reason) for o in (outs[f"r{i}"] for i, _, _ in stops)])
        m = engine.get_metrics()
        assert m["num_free_blocks"] == m["num_total_blocks"]
    assert results[0] == results[2] and results[1] == results[2]
    for (i, stop, j), (ids, text, reason, stop_reason) in zip(stops, results[0]):
        assert len(ids) == j + 1 and reason == "stop" and stop_reason == stop


@OVERLAP
def test_a_failed_step_is_rolled_back_and_recomputed(overlap):
    engine, ex = make_engine(async_scheduling=overlap)
    cases = [prompt(6 + i, i) for i in range(3)]
    for i, p in enumerate(cases):
        engine.add_request(f"r{i}", None, greedy(30), prompt_token_ids=p)
    ex.fail_step = 6
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(100):
            engine.step()
    ex.history.clear()   # a failed worker forgets its sequences; the rollback sends them again
    outs = run(engine)
    for i, p in enumerate(cases):
        assert outs[f"r{i}"].outputs[0].token_ids == expected_tokens(p, 30)
    assert_idle_and_cache_consistent(engine, ex)


def test_no_speculation_in_a_step_with_more_running_sequences_than_the_limit():
    spec = dict(NGRAM, disable_by_batch_size=2)
    engine, ex = make_engine(spec=spec)
    lens = [10, 20, 30, 60, 90]
    for i, mt in enumerate(lens):
        engine.add_request(f"r{i}", None, greedy(mt), prompt_token_ids=prompt(8, i))
    outs = run(engine)
    for i, mt in enumerate(lens):
        assert outs[f"r{i}"].outputs[0].token_ids == expected_tokens(prompt(8, i), mt)
    with_drafts = [p for p in ex.plans if len(p.num_draft_tokens) and p.num_draft_tokens.max() > 0]
    assert with_drafts and all(len(p.seq_ids) <= 2 for p in with_drafts)


def never_predictable(history):
    """A target n-gram lookup does not predict: a hash of the whole history."""
    return (sum(h * (i + 1) for i, h in enumerate(history)) * 2654435761 >> 7) % (V - 1) + 1


def test_a_sequence_whose_drafts_are_rejected_stops_proposing():
    """Over 300 tokens of a target that lookup never predicts, the pauses (8, 16, ... 128 tokens
    after the first few rejected steps) leave at most a dozen verifying steps."""
    engine, ex = make_engine(target=never_predictable)
    p = prompt(8)
    engine.add_request("r", None, greedy(300), prompt_token_ids=p)
    outs = run(engine)
    want, h = [], list(p)
    for _ in range(300):
        h.append(never_predictable(h))
    assert outs["r"].outputs[0].token_ids == h[len(p):]
    m = engine.get_metrics()
    assert 0 < m["spec_decode_num_drafts"] <= 12


@OVERLAP
def test_model_length_token_budget_and_min_tokens_bound_the_drafts(overlap):
    """Drafts never run a sequence past max_model_len, fit a small step budget beside chunked
    prefills, and start only once min_tokens are out (a stop token before that is no stop)."""
    engine, ex = make_engine(async_scheduling=overlap, max_model_len=48, max_num_batched_tokens=6)
    p_long, p = prompt(30, 4), prompt(9, 5)
    stop = expected_tokens(p, 30)[3]
    engine.add_request("len", None, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
                       prompt_token_ids=p)
    engine.add_request("chunked", None, greedy(10), prompt_token_ids=p_long)
    engine.add_request("min", None, greedy(30, stop_token_ids=[stop], min_tokens=8), prompt_token_ids=p)
    outs = run(engine)
    assert outs["len"].outputs[0].token_ids == expected_tokens(p, 48 - len(p))
    assert outs["len"].outputs[0].finish_reason == "length"
    assert outs["chunked"].outputs[0].token_ids == expected_tokens(p_long, 10)
    want = expected_tokens(p, 30)
    cut = next(i for i, t in enumerate(want) if t == stop and i + 1 >= 8)
    assert outs["min"].outputs[0].token_ids == want[:cut + 1]
    assert max(p.num_tokens for p in ex.plans) <= 6
    assert all(int(p.positions.max()) < 48 for p in ex.plans)
    assert engine.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    assert_idle_and_cache_consistent(engine, ex)
