"""``--kv-cache-dtype``: the option from the command line to the worker, the block count it buys,
refusals, and the engine paths that move KV blocks (prefix caching, preemption, copy-on-write)
with a bfloat16 cache on the default model.

With a bfloat16 cache the reference for "equals" is the same engine paths over the same cache
dtype (prefix caching on vs off, a tiny pool vs an ample one, a block copied vs computed in place):
the kernels' own results over the rounded cache are tested in tests/kernels/test_kernels_cpu.py, and the
distance from the float32 cache in tests/model/test_forward.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from folio import SamplingParams
from folio.cli import build_parser
from folio.runtime.common.config import EngineConfig
from folio.runtime.worker.model_runner import ModelRunner, kv_cache_dtype
from support.engine_cases import DEFAULT_REGION, GREEDY2, NUM_BLOCKS, TEXTS, BlockRegion, long_prompt, make_llm
from support.runner_plans import CASE_A, Seq, finish_plan, make_plan


def test_engine_config_takes_vllms_names_only():
    assert EngineConfig().kv_cache_dtype == "auto"
    for name in ("auto", "float32", "bfloat16"):
        assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    for bad in ("fp8", "float16", "bf16", ""):
        with pytest.raises(ValueError, match="kv_cache_dtype must be auto, float32, bfloat16"):
            EngineConfig(kv_cache_dtype=bad)


@pytest.mark.parametrize("argv", [["serve"], ["repl", "--model", "m"], ["generate", "--prompt", "x"],
                                  ["bench", "throughput"]])
def test_every_engine_command_takes_the_flag(argv, capsys):
    parser = build_parser()
    assert parser.parse_args(argv).kv_cache_dtype == "auto"
    assert parser.parse_args(argv + ["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(argv + ["--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_serve_flags_reach_the_engine_config():
    from folio.cmd_serve import engine_config_from_args
    a = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert engine_config_from_args(a).kv_cache_dtype == "bfloat16"


def test_a_dtype_the_device_does_not_run_is_refused_naming_the_flag():
    from folio.kernels import get_kernels
    cpu = get_kernels("cpu")
    assert kv_cache_dtype(cpu, "auto", "cpu") == np.float32
    assert kv_cache_dtype(cpu, "float32", "cpu") == np.float32
    assert kv_cache_dtype(cpu, "bfloat16", "cpu") == np.uint16
    # the CUDA table's own (kernels/cuda/table.py: a bfloat16 cache only), without a GPU
    cuda_like = SimpleNamespace(kv_cache_dtype=np.dtype(np.uint16), kv_cache_dtypes={"bfloat16": np.dtype(np.uint16)})
    assert kv_cache_dtype(cuda_like, "auto", "cuda") == np.uint16
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float32 is not available on cuda; it takes auto, bfloat16"):
        kv_cache_dtype(cuda_like, "float32", "cuda")


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": True}


def test_a_16_bit_cache_gets_twice_the_blocks_for_one_budget(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    f32_block = 16 * 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, 4 bytes
    runners = {}
    for name in ("auto", "bfloat16"):
        runners[name] = r = ModelRunner(EngineConfig(model=str(tmp_path), device="cpu", load_format="dummy",
                                                     kv_cache_memory=f32_block * 5 + 1, kv_cache_dtype=name))
    assert runners["auto"].bytes_per_block == f32_block and runners["auto"].num_blocks == 5
    assert runners["bfloat16"].bytes_per_block == f32_block // 2 and runners["bfloat16"].num_blocks == 10
    assert all(c.dtype == np.float32 for pair in runners["auto"].kv_caches for c in pair)
    assert all(c.dtype == np.uint16 and c.shape == (10, 16, 2, 16) for pair in runners["bfloat16"].kv_caches
               for c in pair)
    assert runners["bfloat16"].kv_cache_dtype == np.uint16


# -- a bfloat16 cache through the engine (the default model) --------------------------------------------


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(EngineConfig(device="cpu", num_kv_blocks_override=NUM_BLOCKS, kv_cache_dtype="bfloat16"))
    assert r.kv_caches[0][0].dtype == np.uint16
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def llm(runner):
    from folio import LLM
    return LLM(executor=BlockRegion(runner, 0, DEFAULT_REGION), device="cpu")


def test_prefix_caching_on_equals_off(runner, llm):
    base = long_prompt(llm, 40)
    prompts = [base + tail for tail in ([11], [12, 13], [14, 15, 16])]
    off = make_llm(runner, enable_prefix_caching=False)
    on = make_llm(runner)
    res_off = off.generate([{"prompt_token_ids": p} for p in prompts], GREEDY2, use_tqdm=False)
    res_on = on.generate([{"prompt_token_ids": p} for p in prompts], GREEDY2, use_tqdm=False)
    res_on2 = on.generate([{"prompt_token_ids": p} for p in prompts], GREEDY2, use_tqdm=False)
    assert all(o.num_cached_tokens == 32 for o in res_on2)   # read back from the bfloat16 blocks
    for a, b, c in zip(res_off, res_on, res_on2):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_tiny_pool_with_preemptions_equals_ample(runner, llm):
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
    prompts = [tok.encode(t) for t in TEXTS[3:7]]
    ample = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    tiny = make_llm(runner, num_blocks=4, enable_prefix_caching=False)
    small = tiny.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert tiny.get_metrics()["num_preemptions"] > 0
    for a, b in zip(ample, small):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_block_copy_equals_the_block_computed_in_place(runner):
    # copy-on-write on the worker: a prompt prefilled into block 3 and decoded there, against the
    # same prompt prefilled into block 4, copied 4 -> 7 (uint16 bits) and decoded from block 7:
    # the same greedy token (two rows of one batch may differ in their last float32 bits, hence
    # by a bfloat16 ulp in the cache: compared as tokens, the copy as bits)
    prompt = CASE_A["prompt_ids"]
    greedy = SamplingParams(temperature=0.0)
    for kc, vc in runner.kv_caches:   # blocks other tests' engines used before
        for blk in (3, 4, 7):
            kc[blk] = 0
            vc[blk] = 0
    a = Seq(31, prompt, [3], greedy)
    b = Seq(32, prompt, [4], greedy)
    first = runner.execute(make_plan(0, [a, b], new=[a, b]))
    assert first.error is None
    ta, tb = first.sampled_token_ids.tolist()
    assert ta == tb
    a.tokens.append(ta)
    b.tokens.append(tb)
    b.blocks = [7]
    res = runner.execute(make_plan(1, [a, b], copies=[[4, 7]]))
    assert res.error is None
    assert res.sampled_token_ids.tolist()[0] == res.sampled_token_ids.tolist()[1]
    for kc, vc in runner.kv_caches:   # the copied rows, bit for bit; the decode's row written after the copy
        np.testing.assert_array_equal(kc[7, :len(prompt)], kc[4, :len(prompt)])
        np.testing.assert_array_equal(vc[7, :len(prompt)], vc[4, :len(prompt)])
        assert vc[7, len(prompt)].any() and not vc[4, len(prompt)].any()
    assert runner.execute(finish_plan(2, [31, 32])).error is None


def test_n4_seeded_samples_share_blocks(llm):
    # n > 1: the samples share the prompt's blocks and write their own (copy-on-write of a shared
    # partial block); seeded, the same samples again, and every block back in the pool. Not
    # compared with the request batched among others: a row's float32 results may differ in their
    # last bits with the batch around it (tiles), which the bfloat16 rounding of a key or value can
    # turn into a whole bfloat16 ulp (2^-8), enough to move a temperature-1 sample
    tok = llm.get_tokenizer()
    p = tok.encode("My favourite animal is")
    sp = SamplingParams(n=4, temperature=1.0, seed=42, max_tokens=6, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
    samples = [o.token_ids for o in first.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2, 3] and all(len(s) == 6 for s in samples)
    assert len({tuple(s) for s in samples}) > 1
    again = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == samples
    assert llm.get_metrics()["num_free_blocks"] == DEFAULT_REGION


def test_precompile_jobs_take_the_cache_dtype():
    # runtime/worker/precompile.py: the jobs' KV cache arrays (F4, kernels/cpu/compile_jobs.py) are
    # of the configured dtype, so a bfloat16 server compiles the uint16 variants and the default one
    # the float32 ones only (test_warm_up.py checks that each covers its engine's warm-up)
    from numba import types

    from folio.kernels.cpu.compile_jobs import argument_types
    from folio.runtime.worker import precompile
    assert argument_types()["F4"].dtype == types.float32
    assert argument_types("float32")["F4"].dtype == types.float32
    assert argument_types("bfloat16")["F4"].dtype == types.uint16
    assert argument_types("bfloat16")["F3"].dtype == types.float32
    job = next(j for j in precompile.JOBS if j.function == "_copy_blocks_kernel")
    fn, sig = job.dispatcher, job.types("bfloat16")
    precompile.compile_job(job, "bfloat16")
    assert sig in fn.signatures and sig[0].dtype == types.uint16
