"""Speculative verification on the worker (``ModelRunner`` with ``StepPlan.num_draft_tokens``), on
the CPU with the default model and on the CUDA table under the SIMT emulator.

Independent expectations: on the CPU the golden greedy tokens of tests/data/smollm2_135m.json
(Hugging Face transformers on the same weights): drafts equal to them are all accepted and the
tokens emitted are theirs; a wrong draft is rejected at its own position, and the token after the
accepted ones is the golden one; the emitted tokens' logprobs are those of one whole prefill of
the sequence, within two float32 schedules' rounding (``support.numerics.forward_logit_atol``). On the emulated GPU (no golden file for a random-weight model)
the same runner decoding one token per step gives the reference, for a greedy sequence verifying
drafts beside sampled rows (seeded, penalties, logprobs) whose tokens must not change.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from folio.runtime.common.config import EngineConfig
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.common.step import NewSequence, StepPlan

from support.numerics import forward_logit_atol

BS = 16


class Seq:
    """One sequence as the scheduler would keep it: tokens, computed count, blocks."""

    def __init__(self, seq_id, prompt, blocks, params, seed=None):
        self.seq_id, self.tokens, self.blocks = seq_id, list(prompt), list(blocks)
        self.done = 0
        self.new = NewSequence(seq_id, list(prompt), [], params.to_dict(), seed, [2])


def plan(step_id, seqs, drafts=None, new=(), bs=BS):
    """Each sequence computes its tokens from ``done`` on, then its drafts (``drafts[seq_id]``),
    and samples its last row."""
    drafts = drafts or {}
    ids, pos, slots, qsl, lens, rows, nd = [], [], [], [0], [], [], []
    table = np.zeros((len(seqs), max(len(s.blocks) for s in seqs)), np.int32)
    for i, s in enumerate(seqs):
        d = list(drafts.get(s.seq_id, []))
        toks = s.tokens[s.done:] + d
        p = np.arange(s.done, s.done + len(toks))
        ids += toks
        pos += p.tolist()
        slots += (np.asarray(s.blocks)[p // bs] * bs + p % bs).tolist()
        qsl.append(qsl[-1] + len(p))
        lens.append(int(p[-1]) + 1)
        rows.append(qsl[-1] - 1)
        nd.append(len(d))
        table[i, :len(s.blocks)] = s.blocks
    return StepPlan(step_id=step_id, input_ids=np.array(ids, np.int64), positions=np.array(pos, np.int64),
                    slot_mapping=np.array(slots, np.int64), query_start_loc=np.array(qsl, np.int32),
                    seq_lens=np.array(lens, np.int32), block_tables=table,
                    seq_ids=np.array([s.seq_id for s in seqs], np.int64), logits_indices=np.array(rows, np.int64),
                    sample_seq_ids=np.array([s.seq_id for s in seqs], np.int64), new_seqs=[s.new for s in new],
                    num_draft_tokens=np.array(nd, np.int64) if drafts else np.zeros(0, np.int64))


def apply(seqs, res, drafts=None):
    """What the scheduler does with a result: append the accepted drafts and the sampled token;
    the computed count covers the tokens known before the step and the accepted drafts."""
    drafts = drafts or {}
    acc = res.num_accepted_tokens if res.num_accepted_tokens is not None else np.zeros(len(seqs), np.int64)
    for s, t, a in zip(seqs, res.sampled_token_ids.tolist(), acc.tolist()):
        s.done = len(s.tokens) + a
        s.tokens += list(drafts.get(s.seq_id, []))[:a] + [t]


def whole_prefill_logits(runner, tokens, bs=BS) -> np.ndarray:
    """``[len(tokens), V]`` float32 logits of every position of ``tokens``, one prefill over a
    fresh KV cache (the reference schedule)."""
    from folio.model.attention_metadata import AttentionMetadata
    from folio.model.loader import allocate_kv_caches
    n = len(tokens)
    nb = -(-n // bs)
    caches = allocate_kv_caches(runner.model_config, nb, bs, runner.kernels)
    md = AttentionMetadata(np.arange(n, dtype=np.int64), np.array([0, n], np.int32), np.array([n], np.int32),
                           np.arange(nb, dtype=np.int32)[None, :], n, n)
    return np.asarray(runner.model.forward(np.array(tokens, np.int64), np.arange(n, dtype=np.int64), md, caches,
                                           np.arange(n, dtype=np.int64)))


@pytest.fixture(scope="module")
def cpu_runner():
    from folio.runtime.worker.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(device="cpu", num_kv_blocks_override=64,
                                 speculative_config={"num_speculative_tokens": 4}))
    yield r
    r.shutdown()


def test_cpu_drafts_of_the_golden_tokens_are_accepted_and_a_wrong_one_rejected(cpu_runner, golden):
    case = next(c for c in golden["greedy_cases"] if c["id"] == "d")   # a 300-token prompt
    want = case["generated_ids_32_ignore_eos"]
    s = Seq(1000, case["prompt_ids"], range(24), SamplingParams(temperature=0.0, logprobs=2))
    lps = []
    res = cpu_runner.execute(plan(0, [s], new=[s]))
    assert res.error is None and res.num_accepted_tokens is None
    apply([s], res)
    step = 1
    # all right, then one wrong draft at each place (the target is the golden token before it)
    for wrong_at in (None, 0, 1, 3):
        n_out = len(s.tokens) - len(case["prompt_ids"])
        d = list(want[n_out:n_out + 4])
        if wrong_at is not None:
            d[wrong_at] = (d[wrong_at] + 1) % 49152
        res = cpu_runner.execute(plan(step, [s], {s.seq_id: d}))
        step += 1
        assert res.error is None, res.error
        a = 4 if wrong_at is None else wrong_at
        assert res.num_accepted_tokens.tolist() == [a]
        assert res.sampled_token_ids.tolist() == [want[n_out + a]]
        assert res.logprobs.shape[0] == a + 1   # one row per emitted token
        assert res.logprob_token_ids[:, 0].tolist() == want[n_out:n_out + a + 1]
        lps.append(res.logprobs[:, 0])
        apply([s], res, {s.seq_id: d})
    P = len(case["prompt_ids"])
    n_out = len(s.tokens) - P
    assert s.tokens[P:] == want[:n_out]
    # logprobs of the tokens emitted by verifying steps against one whole prefill's log-softmax:
    # logit minus log-sum-exp, each within the logit bound of two schedules
    logits = whole_prefill_logits(cpu_runner, s.tokens[:-1])[P - 1:].astype(np.float64)
    ref = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    ref = ref[np.arange(n_out), s.tokens[P:]][1:]   # the first token came from the prefill step
    c = cpu_runner.model_config
    tol = 2 * forward_logit_atol(c.num_hidden_layers, max(c.hidden_size, c.intermediate_size), logits)
    np.testing.assert_allclose(np.concatenate(lps), ref, atol=tol, rtol=0)


# -- the CUDA table under the emulator ---------------------------------------------------------------
TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 211, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def modules():
    from simt.runner import require_compiler
    require_compiler()
    from simt.table import simt_modules
    return simt_modules()


def cuda_runner(modules, tmp_path, monkeypatch, max_num_seqs=4):
    from folio.kernels.cuda import sources as cuda_sources
    from folio.kernels.cuda import table as cuda_ops
    from folio.kernels.cuda.device import HostDevice
    from folio.runtime.worker.model_runner import ModelRunner
    from simt.table import numpy_gemm
    table = cuda_ops.CudaKernels(np, lambda n: modules[n].get_function(n), gemm=numpy_gemm, smem_limit=227 * 1024,
                                 device=HostDevice(), kernel_names=cuda_sources.all_kernel_names())
    monkeypatch.setattr(cuda_ops, "_TABLE", table)
    d = tmp_path / "tiny"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY))
    return ModelRunner(EngineConfig(model=str(d), device="cuda", load_format="dummy", block_size=8,
                                    max_num_seqs=max_num_seqs, max_num_batched_tokens=64 * max_num_seqs,
                                    max_model_len=128, num_kv_blocks_override=256, seed=5,
                                    speculative_config={"num_speculative_tokens": 3,
                                                        "disable_by_batch_size": max_num_seqs}))


SIDE = [SamplingParams(temperature=0.9, top_k=20, seed=3, logprobs=2),
        SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.2)]


def _seqs():
    rng = np.random.default_rng(0)
    greedy = Seq(0, rng.integers(3, 200, 11).tolist(), range(0, 8), SamplingParams(temperature=0.0, logprobs=1))
    side = [Seq(1 + i, rng.integers(3, 200, 6 + 3 * i).tolist(), range(8 * (i + 1), 8 * (i + 2)), p, seed=7 + i)
            for i, p in enumerate(SIDE)]
    return [greedy] + side


def test_cuda_verification_beside_sampled_rows_equals_one_token_per_step(modules, tmp_path, monkeypatch):
    steps = 8
    # reference: one token per step for every sequence
    r = cuda_runner(modules, tmp_path, monkeypatch)
    seqs = _seqs()
    apply(seqs, r.execute(plan(0, seqs, new=seqs, bs=8)))
    for k in range(3 * steps):
        res = r.execute(plan(1 + k, seqs, bs=8))
        assert res.error is None, res.error
        apply(seqs, res)
    ref = [list(s.tokens) for s in seqs]
    r.shutdown()
    # speculative: the greedy sequence verifies drafts (right ones, then a wrong one) while the
    # others decode beside it; each side row samples once per step, as before
    r = cuda_runner(modules, tmp_path, monkeypatch)
    seqs = _seqs()
    apply(seqs, r.execute(plan(0, seqs, new=seqs, bs=8)))
    g = seqs[0]
    accepted = []
    for k in range(steps):
        pos = len(g.tokens)
        d = ref[0][pos:pos + 3] if k % 2 == 0 else [ref[0][pos], (ref[0][pos + 1] + 1) % 211]
        res = r.execute(plan(1 + k, seqs, {g.seq_id: d}, bs=8))
        assert res.error is None, res.error
        accepted.append(int(res.num_accepted_tokens[0]))
        assert res.num_accepted_tokens[1:].tolist() == [0, 0]
        apply(seqs, res, {g.seq_id: d})
        if len(g.tokens) + 4 > len(ref[0]):
            break
    r.shutdown()
    assert accepted[0] == 3 and 1 in accepted
    assert g.tokens == ref[0][:len(g.tokens)]
    for s, want in zip(seqs[1:], ref[1:]):
        assert s.tokens == want[:len(s.tokens)]


# -- sampling: the distribution of the emitted tokens is the target's ---------------------------------
Z_1E6 = 4.753   # the standard normal's 1 - 1e-6 quantile


def chi2_threshold(df: int, z: float = Z_1E6) -> float:
    """The chi-square distribution's quantile at the normal quantile ``z`` (Wilson and Hilferty
    1931: (X / df) ** (1/3) is close to normal with mean 1 - 2 / (9 df) and variance 2 / (9 df);
    within 1% of the exact quantile for df >= 3 at these tails)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * c ** 0.5) ** 3


def chi2_check(samples: list[int], p: np.ndarray, what: str) -> None:
    """Pearson's chi-square of ``samples`` against the probabilities ``p`` (``[V]``, summing to 1):
    tokens with expected count >= 5 are their own category, the rest one more. The threshold is the
    1 - 1e-6 quantile, so a correct sampler fails one such check in a million."""
    n = len(samples)
    counts = np.bincount(np.asarray(samples, dtype=np.int64), minlength=len(p)).astype(np.float64)
    big = n * p >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(n * p[big], n * p[~big].sum())
    assert counts[p == 0].sum() == 0, f"{what}: sampled a token of probability 0"
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 2, f"{what}: too few categories"
    assert stat <= chi2_threshold(df), f"{what}: chi-square {stat:.1f} over {chi2_threshold(df):.1f} (df {df})"


def target_probs(logits: np.ndarray, temperature: float, top_k: int) -> np.ndarray:
    """``[V]`` float64: softmax(logits / temperature) over the ``top_k`` largest, 0 elsewhere
    (NumPy, the sampler's documented semantics)."""
    x = logits.astype(np.float64) / temperature
    keep = x >= np.sort(x)[-top_k]
    w = np.where(keep, np.exp(x - x.max()), 0.0)
    return w / w.sum()


def sampled_under_speculation(runner, prompt, drafts, n, chunk, params, bs, step0=100):
    """``n`` sequences, each with its own seed, sharing ``prompt[:-1]``'s computed blocks: each
    verifies ``drafts`` after ``prompt[-1]`` in one step (``chunk`` sequences per step). Returns each
    one's emitted tokens."""
    P = len(prompt) - 1
    assert P % bs == 0 and len(drafts) < bs
    shared = list(range(P // bs))
    pre = Seq(10_000, prompt[:-1], shared, params)
    pl = plan(step0, [pre], bs=bs)
    pl.logits_indices = pl.sample_seq_ids = np.zeros(0, np.int64)   # computes the prompt, samples nothing
    assert runner.execute(pl).error is None
    out = []
    for c in range(0, n, chunk):
        seqs = []
        for i in range(c, min(n, c + chunk)):
            s = Seq(20_000 + i, prompt, shared + [len(shared) + i - c], params, seed=i)
            s.done = P
            seqs.append(s)
        res = runner.execute(plan(step0 + 1 + c, seqs, {s.seq_id: drafts for s in seqs}, new=seqs, bs=bs))
        assert res.error is None, res.error
        apply(seqs, res, {s.seq_id: drafts for s in seqs})
        out += [s.tokens[len(prompt):] for s in seqs]
    return out


def check_speculative_sampling(runner, prompt, n, chunk, bs, temperature, top_k, vocab):
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=16, logprobs=1)
    p0 = target_probs(whole_prefill_logits(runner, prompt, bs)[-1], temperature, top_k)
    x1 = int(np.argmax(p0))
    p1 = target_probs(whole_prefill_logits(runner, prompt + [x1], bs)[-1], temperature, top_k)
    x2 = int(np.argmax(p1))
    drafts = [x1, x2, (x2 + 7) % vocab]
    emitted = sampled_under_speculation(runner, prompt, drafts, n, chunk, params, bs)
    chi2_check([e[0] for e in emitted], p0, "the first token")
    second = [e[1] for e in emitted if e[0] == x1]
    assert len(second) >= 200, "too few accepted first drafts to test the second token"
    chi2_check(second, p1, "the second token, the first draft accepted")
    # how many drafts each sequence kept, against its own tokens (never more than agree)
    for e in emitted:
        a = len(e) - 1
        assert e[:a] == drafts[:a] and (a == 3 or e[a] != drafts[a])


@pytest.mark.slow
def test_cpu_sampled_drafts_keep_the_target_distribution(cpu_runner, golden):
    prompt = golden["greedy_cases"][2]["prompt_ids"][:17]   # 16 computed tokens, one block, then one more
    check_speculative_sampling(cpu_runner, prompt, n=1200, chunk=60, bs=BS, temperature=1.3, top_k=12,
                               vocab=cpu_runner.model_config.vocab_size)


def test_cuda_sampled_drafts_keep_the_target_distribution(modules, tmp_path, monkeypatch):
    r = cuda_runner(modules, tmp_path, monkeypatch, max_num_seqs=128)
    prompt = list(np.random.default_rng(3).integers(3, 200, 9))   # 8 computed tokens (one block of 8), then one
    # a low temperature: the random-weight model's first draft is accepted often enough to test the second
    check_speculative_sampling(r, prompt, n=1000, chunk=125, bs=8, temperature=0.08, top_k=20, vocab=211)
    r.shutdown()
