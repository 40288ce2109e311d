"""ModelRunner on the real default model with plans built by hand (the scheduler's side of the
contract), checked against the golden greedy tokens, a NumPy penalty reference, and KV sizing
arithmetic."""

import json

import numpy as np
import pytest
from support.numerics import forward_logit_atol

from folio.model.attention_metadata import AttentionMetadata
from folio.model.loader import allocate_kv_caches
from folio.runtime.common.config import EngineConfig
from folio.runtime.worker.model_runner import ModelRunner, max_useful_blocks, mem_available_bytes, num_kv_blocks
from folio.runtime.common.sampling_params import SamplingParams
from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID, NewSequence

from support import GOLDEN_PATH
from support.runner_plans import BS, CASE_A, Seq, finish_plan, make_plan

GOLDEN = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def runner(default_model_dir):
    r = ModelRunner(EngineConfig(model=str(default_model_dir), device="cpu", max_model_len=512,
                                 num_kv_blocks_override=NUM_BLOCKS, seed=3))
    yield r
    r.shutdown()


def run(runner, seqs, steps, step0=0, finish=True):
    """Prefill + decode ``steps`` tokens for ``seqs`` together; returns their generated ids."""
    out = {s.seq_id: [] for s in seqs}
    for k in range(steps):
        res = runner.execute(make_plan(step0 + k, seqs, new=seqs if k == 0 else ()))
        assert res.error is None, res.error
        assert res.step_id == step0 + k and res.forward_time > 0
        for s, t in zip(seqs, res.sampled_token_ids.tolist()):
            s.tokens.append(t)
            out[s.seq_id].append(t)
    if finish:
        res = runner.execute(finish_plan(step0 + steps, [s.seq_id for s in seqs]))
        assert res.error is None
    return out


def test_golden_greedy_tokens(runner):
    s = Seq(1, CASE_A["prompt_ids"], [5, 9], SamplingParams(temperature=0.0, max_tokens=8))
    out = run(runner, [s], 8)
    assert out[1][0] == 7042
    assert out[1] == CASE_A["generated_ids_until_eos"][:8]
    assert runner.num_active_sequences == 0


def test_runner_is_a_step_runner(runner):
    from folio.runtime.common.executor import StepRunner
    assert isinstance(runner, StepRunner)


def test_placeholder_inputs_take_the_previous_sample(runner):
    # overlap scheduling: decode plans built before the previous token is known carry
    # placeholders; the runner feeds the token it sampled for that sequence in the step before
    s = Seq(11, CASE_A["prompt_ids"], [20, 21], SamplingParams(temperature=0.0, max_tokens=8))
    res = runner.execute(make_plan(1, [s], new=[s]))
    got = res.sampled_token_ids.tolist()
    for k in range(2, 7):
        s.tokens.append(-1)  # unknown to the "scheduler": a placeholder
        plan = make_plan(k, [s])
        assert plan.input_ids.tolist() == [PLACEHOLDER_TOKEN_ID]
        res = runner.execute(plan)
        assert res.error is None, res.error
        got += res.sampled_token_ids.tolist()
    assert got == CASE_A["generated_ids_until_eos"][:6]
    assert runner.execute(finish_plan(7, [11])).error is None


def test_block_copy_before_forward(runner):
    """Prefill into block 3, copy 3 -> 7 in the plan, decode from block 7: same token as golden."""
    prompt = CASE_A["prompt_ids"]
    s = Seq(2, prompt, [3], SamplingParams(temperature=0.0))
    res = runner.execute(make_plan(0, [s], new=[s]))
    assert res.sampled_token_ids.tolist() == [7042]
    s.tokens.append(7042)
    s.blocks = [7]
    for kc, _ in runner.kv_caches[:1]:
        kc[7] = 0.0
    res = runner.execute(make_plan(1, [s], copies=[[3, 7]]))
    assert res.error is None and res.sampled_token_ids.tolist() == [CASE_A["generated_ids_until_eos"][1]]
    np.testing.assert_array_equal(runner.kv_caches[0][0][7, :len(prompt)], runner.kv_caches[0][0][3, :len(prompt)])
    runner.execute(finish_plan(2, [2]))


def test_seeded_sampling_same_alone_and_batched(runner):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=4)
    alone = run(runner, [Seq(10, CASE_A["prompt_ids"], [0], params, seed=42)], 4)[10]
    batch = [Seq(11, [1604, 3987, 46477, 24, 94, 727], [1], SamplingParams(temperature=1.0)),
             Seq(12, CASE_A["prompt_ids"], [2], params, seed=42),
             Seq(13, [504, 2988, 314], [4], SamplingParams(temperature=0.0))]
    got = run(runner, batch, 4, step0=100)
    assert got[12] == alone
    other_seed = run(runner, [Seq(14, CASE_A["prompt_ids"], [0], params, seed=43)], 4)[14]
    assert other_seed != alone  # fixed seeds: these two streams differ within 4 tokens


def test_restored_sequence_resumes_its_random_stream(runner):
    params = SamplingParams(temperature=1.0, max_tokens=6)
    full = run(runner, [Seq(20, CASE_A["prompt_ids"], [0], params, seed=7)], 6)[20]
    # preempted after 3 tokens: re-sent with its outputs, recomputed from scratch
    s = Seq(21, CASE_A["prompt_ids"] + full[:3], [1], params, seed=7)
    s.new = NewSequence(21, CASE_A["prompt_ids"], full[:3], params.to_dict(), 7, [2])
    assert run(runner, [s], 3)[21] == full[3:]


def ref_penalise(logits, history_prompt, history_out, rep, freq, pres):
    x = logits.astype(np.float64).copy()
    for t in set(history_prompt) | set(history_out):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(history_out):
        c = history_out.count(t)
        x[t] -= freq * c + pres
    return x


def test_penalties_use_prompt_and_output_history(runner):
    """Each greedy token equals the argmax of the model's raw logits penalised by a NumPy reference."""
    rep, freq, pres = 1.3, 0.4, 0.3
    prompt = CASE_A["prompt_ids"]
    s = Seq(30, prompt, [0], SamplingParams(temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                                            presence_penalty=pres))
    got = run(runner, [s], 5)[30]
    model, cfg = runner.model, runner.model_config
    outs = []
    for k in range(5):
        seq = prompt + outs
        caches = allocate_kv_caches(cfg, 2, BS, runner.kernels)
        n = len(seq)
        md = AttentionMetadata(np.arange(n, dtype=np.int64), np.array([0, n], np.int32), np.array([n], np.int32),
                               np.array([[0, 1]], np.int32), n, n)
        raw = model.forward(np.array(seq, np.int64), np.arange(n, dtype=np.int64), md, caches,
                            np.array([n - 1], np.int64))[0]
        outs.append(int(np.argmax(ref_penalise(raw, prompt, outs, rep, freq, pres))))
    assert got == outs
    assert got != CASE_A["generated_ids_until_eos"][:5]  # the penalties changed something


def test_logprobs_in_step_result(runner):
    s = Seq(40, CASE_A["prompt_ids"], [0], SamplingParams(temperature=0.0, logprobs=5))
    res = runner.execute(make_plan(0, [s], new=[s]))
    assert res.logprobs.shape == (1, 6)
    lc = GOLDEN["logits_capital"]
    # the sampled (greedy) token, then Hugging Face's top 5
    assert res.logprob_token_ids[0].tolist() == [lc["top5_ids"][0], *lc["top5_ids"]]
    # logit - logsumexp of two float32 implementations (folio, Hugging Face): each term within
    # two schedules' rounding (tests/support/numerics.py; the logsumexp's error is at most its logits')
    c = runner.model_config
    atol = 2 * forward_logit_atol(c.num_hidden_layers, max(c.hidden_size, c.intermediate_size),
                                  np.array(lc["top5_logits"]), schedules=2)
    np.testing.assert_allclose(res.logprobs[0, 1:], np.array(lc["top5_logits"]) - lc["logsumexp"],
                               atol=atol, rtol=0)
    runner.execute(finish_plan(1, [40]))


def test_errors_become_step_results(runner):
    s = Seq(50, CASE_A["prompt_ids"], [0], SamplingParams(temperature=0.0))
    res = runner.execute(make_plan(0, [s]))  # never sent in new_seqs
    assert res.error is not None and "50" in res.error and res.sampled_token_ids.size == 0
    bad = Seq(51, CASE_A["prompt_ids"], [0], SamplingParams(temperature=0.0))
    bad.new.sampling["temperature"] = -1.0
    res = runner.execute(make_plan(1, [bad], new=[bad]))
    assert res.error is not None and "temperature" in res.error
    ok = Seq(52, CASE_A["prompt_ids"], [0], SamplingParams(temperature=0.0))
    assert run(runner, [ok], 1)[52] == [7042]  # still serving


def test_chunked_prefill_step_samples_nothing(runner):
    prompt = CASE_A["prompt_ids"]
    s = Seq(60, prompt[:3], [0], SamplingParams(temperature=0.0))
    plan = make_plan(0, [s], new=[s])
    plan.logits_indices = np.zeros(0, np.int64)
    plan.sample_seq_ids = np.zeros(0, np.int64)
    res = runner.execute(plan)
    assert res.error is None and res.sampled_token_ids.size == 0
    s.tokens = list(prompt)
    res = runner.execute(make_plan(1, [s]))
    assert res.sampled_token_ids.tolist() == [7042]
    runner.execute(finish_plan(2, [60]))


def test_kv_sizing_arithmetic():
    kw = dict(block_size=16, max_num_seqs=4, max_model_len=100)
    assert max_useful_blocks(4, 100, 16) == 25 + 4
    assert num_kv_blocks(1000, num_blocks_override=7, **kw) == 7
    assert num_kv_blocks(1000, kv_cache_memory=12_345, **kw) == 12
    assert num_kv_blocks(1000, available_bytes=20_500, **kw) == 20
    assert num_kv_blocks(1000, available_bytes=10**9, **kw) == 29  # capped
    with pytest.raises(ValueError, match="no block"):
        num_kv_blocks(1000, kv_cache_memory=999, **kw)
    with pytest.raises(ValueError):
        num_kv_blocks(1000, **kw)


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": True}


def test_runner_sizes_the_kv_cache_on_cpu(runner, tmp_path, monkeypatch):
    cfg = runner.model_config
    per_block = BS * cfg.kv_bytes_per_token(4)
    assert per_block == BS * 2 * 30 * 3 * 64 * 4
    assert runner.num_blocks == NUM_BLOCKS and runner.kv_caches[0][0].shape == (NUM_BLOCKS, BS, 3, 64)
    assert len(runner.kv_caches) == cfg.num_hidden_layers
    assert mem_available_bytes() > 0

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    tiny_block = BS * 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, float32
    mk = lambda **kw: ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", load_format="dummy", **kw))  # noqa
    # RAM share far larger than 2 sequences x 64 tokens: the cap wins
    r = mk(max_model_len=64, max_num_seqs=2)
    assert r.bytes_per_block == tiny_block and r.num_blocks == max_useful_blocks(2, 64, BS) == 10
    # default max_model_len = max_position_embeddings
    assert r.max_model_len == 64 and mk(max_num_seqs=1).max_model_len == 1024
    assert mk(kv_cache_memory=tiny_block * 5 + 1).num_blocks == 5
    assert mk(num_kv_blocks_override=3).kv_caches[0][0].shape == (3, BS, 2, 16)
    # the RAM share: cpu_kv_cache_fraction of MemAvailable
    import folio.runtime.worker.model_runner as mr
    monkeypatch.setattr(mr, "mem_available_bytes", lambda: tiny_block * 40)
    assert mk(cpu_kv_cache_fraction=0.5, max_num_seqs=8).num_blocks == 20
    monkeypatch.setattr(mr, "mem_available_bytes", lambda: tiny_block // 2)
    with pytest.raises(ValueError, match="no block"):
        mk()


def test_mem_available_parsing(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       32000000 kB\nMemFree:  1000 kB\nMemAvailable:   23245000 kB\n")
    assert mem_available_bytes(str(f)) == 23245000 * 1024
    f.write_text("MemTotal: 1 kB\n")
    with pytest.raises(RuntimeError, match="MemAvailable"):
        mem_available_bytes(str(f))
