"""Sampler against a per-row float64 NumPy reference written here (independent of the vectorised code)."""

import numpy as np
import pytest

from folio.runtime.worker.sampler import SamplingState, make_rng, sample
from folio.runtime.common.sampling_params import SamplingParams

V = 50


def state(seq_id=0, prompt=(1, 2, 3), out=(), seed=None, eos=(2,), engine_seed=0, **kw):
    return SamplingState(seq_id, SamplingParams(**kw), list(prompt), list(out), seed, list(eos),
                         engine_seed=engine_seed)


def ref_penalised(logits, prompt, out, rep, freq, pres):
    x = logits.astype(np.float64).copy()
    counts = np.zeros(len(x))
    for t in out:
        counts[t] += 1
    for t in range(len(x)):
        if t in prompt or counts[t] > 0:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        x[t] -= freq * counts[t] + pres * (counts[t] > 0)
    return x


def ref_probs(x, temperature, top_k, top_p, min_p):
    """Reference distribution: temperature, min_p, top-k, top-p (over the top-k renormalised)."""
    x = x / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    p[p < min_p * p.max()] = 0
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    kk = top_k if top_k > 0 else len(p)
    q = np.zeros(len(p))
    q[order[:kk]] = p[order[:kk]]
    q /= q.sum()
    mass = 0.0
    for rank, t in enumerate(order[:kk]):
        if q[t] == 0:
            break
        keep[t] = True
        mass += q[t]
        if mass >= top_p:
            break
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def ref_inverse_cdf(probs, u):
    return int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="left"))


def test_greedy_is_argmax_of_penalised_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, V)).astype(np.float32) * 3
    states = [state(i, temperature=0.0) for i in range(4)]
    assert (sample(logits, states).token_ids == logits.argmax(1)).all()


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0), (1.0, 0.6, 0.0),
                                           (1.0, 0.0, -0.8), (1.2, 0.5, 0.5)])
def test_penalties_match_reference(rep, freq, pres):
    rng = np.random.default_rng(1)
    R = 5
    logits = rng.normal(size=(R, V)).astype(np.float32) * 4
    states, refs = [], []
    for i in range(R):
        prompt = rng.integers(0, V, size=rng.integers(1, 12)).tolist()
        out = rng.integers(0, V, size=rng.integers(0, 20)).tolist()
        states.append(state(i, prompt=prompt, out=out, temperature=0.0, repetition_penalty=rep,
                            frequency_penalty=freq, presence_penalty=pres))
        refs.append(ref_penalised(logits[i], set(prompt), out, rep, freq, pres))
    # greedy output = argmax of the reference-penalised logits
    got = sample(logits, states).token_ids
    assert got.tolist() == [int(np.argmax(r)) for r in refs]
    # the penalised logits themselves, through the public helper
    from folio.runtime.worker.sampler import apply_penalties
    f = lambda v: np.full(R, v, dtype=np.float32)  # noqa: E731
    pen = apply_penalties(logits, [s.prompt_token_ids for s in states],
                          [s.output_token_ids for s in states], f(rep), f(freq), f(pres))
    # float32 against the float64 reference: seven roundings per logit at most, each within u = 2^-24
    # of the largest magnitude M in that logit's arithmetic: the three penalties' float32 values,
    # the repetition division or product, frequency x count, + presence, the subtraction. M is at
    # most max|logit| max(rep, 1/rep) + |freq| max count + |pres| (every intermediate is a partial sum
    # of those terms), so |pen - ref| <= 7 u M, absolute (no rtol: the bound is not relative to ref)
    most = max(max(np.unique(s.output_token_ids, return_counts=True)[1], default=0) for s in states)
    m = float(np.abs(logits).max()) * max(rep, 1 / rep) + abs(freq) * most + abs(pres)
    np.testing.assert_allclose(pen, np.stack(refs), rtol=0, atol=7 * 2.0 ** -24 * m)


def test_penalties_only_touch_rows_that_ask():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, V)).astype(np.float32)
    top = int(logits[0].argmax())
    s0 = state(0, prompt=[top], temperature=0.0, repetition_penalty=100.0)
    s1 = state(1, prompt=[int(logits[1].argmax())], temperature=0.0)
    got = sample(logits, [s0, s1]).token_ids
    assert got[0] != top or logits[0, top] <= 0
    assert got[1] == logits[1].argmax()


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.0, top_k=5),
    dict(temperature=0.8, top_p=0.7), dict(temperature=1.2, top_k=10, top_p=0.9),
    dict(temperature=1.0, min_p=0.1), dict(temperature=1.5, top_k=3, min_p=0.05, top_p=0.95)])
def test_random_rows_follow_reference_inverse_cdf(kw):
    rng = np.random.default_rng(3)
    R = 16
    logits = rng.normal(size=(R, V)).astype(np.float32) * 2
    states = [state(i, seed=100 + i, **kw) for i in range(R)]
    got = sample(logits, states).token_ids
    for i in range(R):
        u = 1.0 - np.random.default_rng(100 + i).random()
        probs = ref_probs(logits[i].astype(np.float64), kw["temperature"], kw.get("top_k", 0),
                          kw.get("top_p", 1.0), kw.get("min_p", 0.0))
        assert probs[got[i]] > 0, "sampled a token the reference filters out"
        assert got[i] == ref_inverse_cdf(probs, u)


def test_top_k_one_equals_greedy():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(6, V)).astype(np.float32)
    states = [state(i, temperature=1.0, top_k=1) for i in range(6)]
    assert (sample(logits, states).token_ids == logits.argmax(1)).all()


def test_empirical_distribution_matches():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * 4], dtype=np.float32))
    s = state(0, seed=5, temperature=1.0, top_p=0.9)
    counts = np.zeros(8)
    for _ in range(4000):
        t = sample(logits, [s]).token_ids[0]
        counts[t] += 1
    expect = np.array([0.5, 0.3, 0.15, 0, 0, 0, 0, 0]) / 0.95
    assert counts[3:].sum() == 0
    # each count is Binomial(4000, p): 4.5 standard deviations sqrt(p (1 - p) / 4000) (0.035 for
    # p = 0.53), so a correct sampler lands outside with probability < 1e-5 per token (the seed is
    # fixed: the check is deterministic); a nucleus cut one token early (0.625, 0.375: 0.1 off)
    # fails it, one token late fails the line above
    sigma = np.sqrt(expect * (1 - expect) / 4000)
    assert np.all(np.abs(counts / 4000 - expect) <= 4.5 * sigma), (counts / 4000, expect, sigma)


def test_seeded_row_same_alone_and_in_any_batch():
    rng = np.random.default_rng(6)
    steps = [rng.normal(size=(V,)).astype(np.float32) for _ in range(10)]
    alone = state(7, seed=42, temperature=1.0, top_p=0.95)
    in_batch = state(7, seed=42, temperature=1.0, top_p=0.95)
    others = [state(100 + i, temperature=1.0, engine_seed=9) for i in range(3)]
    greedy = state(200, temperature=0.0)
    a, b = [], []
    for k, lg in enumerate(steps):
        a.append(int(sample(lg[None], [alone]).token_ids[0]))
        alone.append(a[-1])
        batch = others[: k % 4] + [in_batch, greedy]
        pos = len(batch) - 2
        noise = rng.normal(size=(len(batch), V)).astype(np.float32)
        noise[pos] = lg
        t = sample(noise, batch).token_ids
        for st, tok in zip(batch, t):
            st.append(int(tok))
        b.append(int(t[pos]))
    assert a == b


def test_restored_sequence_continues_its_stream():
    rng = np.random.default_rng(7)
    steps = [rng.normal(size=(1, V)).astype(np.float32) for _ in range(8)]
    s = state(3, seed=11, temperature=1.0)
    full = []
    for lg in steps:
        full.append(int(sample(lg, [s]).token_ids[0]))
        s.append(full[-1])
    restored = state(3, seed=11, out=full[:5], temperature=1.0)  # e.g. after preemption
    rest = []
    for lg in steps[5:]:
        rest.append(int(sample(lg, [restored]).token_ids[0]))
        restored.append(rest[-1])
    assert rest == full[5:]


def test_unseeded_streams_depend_on_engine_seed_and_seq_id():
    a = make_rng(None, 0, 1).random(4)
    assert np.array_equal(a, make_rng(None, 0, 1).random(4))
    assert not np.array_equal(a, make_rng(None, 0, 2).random(4))
    assert not np.array_equal(a, make_rng(None, 1, 1).random(4))
    assert np.array_equal(make_rng(5, 0, 1).random(4), np.random.default_rng(5).random(4))


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = np.zeros((3, V), dtype=np.float32)
    logits[:, 2] = 10.0  # eos
    logits[:, 7] = 9.0  # stop token
    logits[:, 9] = 8.0
    s_min = state(0, temperature=0.0, min_tokens=2, stop_token_ids=[7])
    s_done = state(1, temperature=0.0, min_tokens=2, stop_token_ids=[7], out=[5, 5])
    s_ign = state(2, temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[7])
    assert sample(logits, [s_min, s_done, s_ign]).token_ids.tolist() == [9, 2, 2]


def test_logprobs_are_raw_top_k_plus_sampled():
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(3, V)).astype(np.float32) * 2
    states = [state(0, temperature=0.0, logprobs=3, repetition_penalty=1.5, prompt=[0, 1]),
              state(1, temperature=1.0, seed=1, logprobs=0),
              state(2, temperature=0.7, seed=2)]
    out = sample(logits, states)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(1, keepdims=True))
    # float32 log-softmax over V = 50: the log-sum-exp (|.| < 15 here) within a few roundings,
    # the difference one more: below 4 x 15 x 2^-24 + 50 x 2^-24 (the sum) = 7e-6 < 1e-5
    assert out.logprobs.shape == (3, 4) and out.logprob_token_ids.shape == (3, 4)
    assert (out.logprob_token_ids[:, 0] == out.token_ids).all()
    np.testing.assert_allclose(out.logprobs[:, 0], ref[np.arange(3), out.token_ids], atol=1e-5)
    for i in range(3):
        top = np.argsort(-ref[i])[:3]
        assert out.logprob_token_ids[i, 1:].tolist() == top.tolist()
        np.testing.assert_allclose(out.logprobs[i, 1:], ref[i, top], atol=1e-5)


def test_no_logprobs_when_none_asked():
    out = sample(np.zeros((2, V), np.float32), [state(0, temperature=0.0), state(1, seed=1)])
    assert out.logprobs is None and out.logprob_token_ids is None


@pytest.mark.parametrize("scale", [6.0, 0.05])  # peaked: nucleus inside the candidates; flat: fallback
def test_large_vocab_candidate_path_matches_reference(scale):
    import folio.runtime.worker.sampler as sampler_mod
    Vb = 3000
    assert sampler_mod.TOP_CANDIDATES < Vb
    rng = np.random.default_rng(9)
    R = 8
    logits = (rng.normal(size=(R, Vb)) * scale).astype(np.float32)
    kws = [dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_p=0.5),
           dict(temperature=1.0, top_k=1500, top_p=0.99), dict(temperature=1.0, top_k=20),
           dict(temperature=1.0, top_p=0.999), dict(temperature=1.3, top_p=0.8, min_p=0.01),
           dict(temperature=1.0, top_k=2000), dict(temperature=1.0)]
    states = [state(i, seed=300 + i, **kw) for i, kw in enumerate(kws)]
    got = sample(logits, states).token_ids
    for i, kw in enumerate(kws):
        u = 1.0 - np.random.default_rng(300 + i).random()
        probs = ref_probs(logits[i].astype(np.float64), kw["temperature"], kw.get("top_k", 0),
                          kw.get("top_p", 1.0), kw.get("min_p", 0.0))
        assert probs[got[i]] > 0
        assert got[i] == ref_inverse_cdf(probs, u)
