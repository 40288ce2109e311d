"""The CUDA kernels (kernels/cuda/*.cu) equal the NumPy spec (kernels/reference.py) within bounds
derived from the arithmetic (tests/support/cuda_bounds.py).

Without a GPU (CI, default) every kernel runs under the SIMT emulator (tests/simt): the same .cu
sources compiled with g++, launched through the same Python code as on a GPU
(``kernels.cuda.table.CudaKernels`` over NumPy). With ``FOLIO_TEST_CUDA=1`` the same tests run the
real CuPy kernels on the GPU (``perf/gpu_check.sh`` does this).

Cases are the shared random cases of tests/support/kernel_cases.py (the CPU kernel tests use the same).
bf16 storage: caches, weights and the queries are rounded to bf16 first and the reference is given
the rounded values; the kernels' own bf16 roundings (norm, activation and attention outputs, the
prefill's probabilities) and float32 accumulation are what the bounds allow for. Pure data movement
(copy_blocks, casts, embedding; the values rope_and_cache stores) is checked bit for bit.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from support.kernel_cases import cases_for, paged_attention_case

from support import cuda_bounds as B
from folio.kernels.cuda import sources as cuda_sources
from folio.kernels.cuda import table as cuda_ops
from folio.kernels import reference
from folio.kernels.cuda.table import CudaKernels, bf16_bits_to_float32, float32_to_bf16_bits
from simt.runner import require_compiler
from support.fake_raw_kernel import FakeRawKernel

ON_GPU = os.environ.get("FOLIO_TEST_CUDA", "") not in ("", "0")


@pytest.fixture(scope="module")
def kt():
    if ON_GPU:
        from folio.kernels.cuda.table import get_cuda_kernels

        return get_cuda_kernels()
    require_compiler()
    from simt.table import simt_kernels

    return simt_kernels()


def _ids(cases):
    return [c[0] for c in cases]


def _to_dev_bf16(kt, a):
    """float32 NumPy -> device bf16 bits, and the float32 values those bits hold (for the spec)."""
    dev = kt.float32_to_bf16(kt.xp.asarray(a))
    return dev, bf16_bits_to_float32(kt.to_numpy(dev))


def _attention(kt, case, **kw):
    """The kernel's output (as float32) and the spec with its bound, on bf16 q and caches."""
    xp = kt.xp
    q, q32 = _to_dev_bf16(kt, case["q"])
    kc, kc32 = _to_dev_bf16(kt, case["key_cache"])
    vc, vc32 = _to_dev_bf16(kt, case["value_cache"])
    want, bound = B.paged_attention(q32, kc32, vc32, case["block_tables"], case["seq_lens"],
                                    case["query_start_loc"], case["scale"])
    got = kt.paged_attention(q, kc, vc, xp.asarray(case["block_tables"]), xp.asarray(case["seq_lens"]),
                             xp.asarray(case["query_start_loc"]), case["scale"], **kw)
    assert got.dtype == np.uint16 and got.shape == case["q"].shape
    return bf16_bits_to_float32(kt.to_numpy(got)), want, bound


PA_CASES = cases_for("paged_attention")


@pytest.mark.parametrize("case_id,build", PA_CASES, ids=_ids(PA_CASES))
def test_paged_attention(kt, case_id, build):
    case = build()
    got, want, bound = _attention(kt, case)
    B.check(got, want, bound, case_id)
    assert not got[int(case["query_start_loc"][-1]):].any(), "padding rows must be zero"


SPLIT_CASES = [(cid, b) for cid, b in PA_CASES if cid.startswith("decode_ctx") or cid.startswith("mixed")]


@pytest.mark.parametrize("case_id,build", SPLIT_CASES, ids=_ids(SPLIT_CASES))
def test_paged_attention_split_k_partitions(kt, case_id, build):
    # partitions of 32 tokens: a 203-token context is 7 partitions, short ones leave partitions empty
    case = build()
    got, want, bound = _attention(kt, case, partition_size=32)
    B.check(got, want, bound, case_id)


def test_paged_attention_fixed_partition_grid(kt):
    # a CUDA graph captures one grid: 8 partitions of 32 tokens serve every context up to 256,
    # and the one-partition grid (direct output) serves every context up to 32
    case = paged_attention_case(7, [(201, 1), (1, 1), (64, 1), (17, 1)], num_heads=9, num_kv_heads=3,
                                head_dim=64, num_pad_tokens=2)
    got, want, bound = _attention(kt, case, partition_size=32, num_partitions=8, max_seq_len=201, max_query_len=1)
    B.check(got, want, bound, "8 partitions")
    short = paged_attention_case(8, [(17, 1), (32, 1)], head_dim=64)
    got, want, bound = _attention(kt, short, partition_size=32, num_partitions=1, max_seq_len=32, max_query_len=1)
    B.check(got, want, bound, "1 partition")
    with pytest.raises(ValueError, match="cannot hold 201"):
        _attention(kt, case, partition_size=32, num_partitions=4, max_seq_len=201, max_query_len=1)


def test_decode_partitions_are_capped():
    assert cuda_ops.decode_partitioning(100) == (1, 100)
    assert cuda_ops.decode_partitioning(513) == (2, 512)
    assert cuda_ops.decode_partitioning(131072) == (64, 2048)  # Llama 3.1's context: 64 x 2048
    P, part = cuda_ops.decode_partitioning(100000)
    assert P <= cuda_ops.MAX_DECODE_PARTITIONS and P * part >= 100000 and part % 512 == 0


DECODE_CASES = [(cid, b) for cid, b in PA_CASES if cid.startswith("decode_ctx")]


def test_paged_attention_decode_batch_with_padding_and_partitions(kt):
    # several decodes at once (200+ contexts, GQA 3, head_dim 64), padding rows, 4 partitions
    case = paged_attention_case(7, [(201, 1), (1, 1), (64, 1), (17, 1)], num_heads=9, num_kv_heads=3,
                                head_dim=64, num_pad_tokens=2)
    for kw in ({}, {"partition_size": 64}):
        got, want, bound = _attention(kt, case, **kw)
        B.check(got, want, bound, str(kw))
        assert not got[4:].any()


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(128, 8, 2), (256, 8, 2), (128, 32, 4), (64, 16, 1)])
def test_paged_attention_head_dims_and_groups(kt, head_dim, num_heads, num_kv_heads):
    # Llama-3-8B's head shape (128, GQA 4), the largest head_dim (256: KV tiles of 32 keys, more
    # than 48 KiB of shared memory), a GQA group of 8 (the decode kernel's h8 entry point, one pass)
    # and of 16 (4 tokens per prefill tile); a prefill chunk + a decode, then decodes only
    case = paged_attention_case(8, [(40, 21), (30, 1)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim)
    got, want, bound = _attention(kt, case)
    B.check(got, want, bound, "prefill")
    case = paged_attention_case(9, [(70, 1), (3, 1)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim)
    got, want, bound = _attention(kt, case, partition_size=32)
    B.check(got, want, bound, "decode")


@pytest.mark.parametrize("head_dim", [48, 96])
def test_paged_attention_rejects_unsupported_head_dim(kt, head_dim):
    case = paged_attention_case(8, [(5, 1)], num_heads=2, num_kv_heads=1, head_dim=head_dim)
    with pytest.raises(ValueError, match=f"head_dim {head_dim}"):
        _attention(kt, case)


def test_paged_attention_unused_table_entries_ignored(kt):
    case = paged_attention_case(5, [(17, 3), (5, 1)])
    a, _, _ = _attention(kt, case)
    bt = case["block_tables"].copy()
    bt[0, 2:] = 0
    bt[1, 1:] = case["key_cache"].shape[0] - 1
    b, _, _ = _attention(kt, {**case, "block_tables": bt})
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("slots_padding", [0, 5])
def test_rope_and_cache_reads_the_fused_projection(kt, slots_padding):
    # spec: reference.rope_and_cache (RoPE of the q and k slices, then the cache append); the
    # kernel reads q/k/v in place from the [T, (H + 2 Hkv) D] projection and rounds to bf16
    rng = np.random.default_rng(11)
    T, H, Hkv, D, bs, nb = 23, 9, 3, 64, 16, 6
    inv = reference.rope_inv_freq(D, 100000.0)
    cs = reference.rope_cos_sin_cache(inv, 4096)
    pos = rng.integers(0, 4096, T).astype(np.int64)
    qkv = (rng.standard_normal((T, (H + 2 * Hkv) * D)) * 2).astype(np.float32)
    slots = rng.choice(nb * bs, T, replace=False).astype(np.int64)
    slots[rng.choice(T, slots_padding, replace=False)] = -1
    kc0 = rng.standard_normal((nb, bs, Hkv, D)).astype(np.float32)
    vc0 = rng.standard_normal((nb, bs, Hkv, D)).astype(np.float32)
    kc, kc32 = _to_dev_bf16(kt, kc0)
    vc, vc32 = _to_dev_bf16(kt, vc0)
    xp = kt.xp
    q = kt.rope_and_cache(xp.asarray(pos), xp.asarray(qkv), xp.asarray(cs), kc, vc, xp.asarray(slots), H, Hkv)
    want_kc, want_vc = kc32.astype(np.float64), vc32.copy()
    want_q = reference.rope_and_cache(pos, qkv.astype(np.float64), cs, want_kc, want_vc, slots, H, Hkv)
    yq, bq = B.rope(pos, qkv[:, :H * D].reshape(T, H, D), cs)
    B.check(bf16_bits_to_float32(kt.to_numpy(q)), yq, bq, "q")
    # the spec is the same rotation: the same float64 operations in the same order, rounded once
    np.testing.assert_array_equal(want_q, yq.astype(np.float32))
    yk, bk = B.rope(pos, qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D), cs)
    got_k = bf16_bits_to_float32(kt.to_numpy(kc))
    got_v = bf16_bits_to_float32(kt.to_numpy(vc))
    for t, s in enumerate(slots):
        if s >= 0:
            B.check(got_k[s // bs, s % bs], yk[t], bk[t], f"key of token {t}")
    keep = np.ones((nb, bs), bool)
    keep[slots[slots >= 0] // bs, slots[slots >= 0] % bs] = False
    np.testing.assert_array_equal(got_k[keep], kc32[keep])
    np.testing.assert_array_equal(got_v, B.bf16(want_vc))  # values are copied, rounded once


CB_CASES = cases_for("copy_blocks")


@pytest.mark.parametrize("case_id,build", CB_CASES, ids=_ids(CB_CASES))
def test_copy_blocks(kt, case_id, build):
    case = build()
    dev_k = [_to_dev_bf16(kt, c) for c in case["key_caches"]]
    dev_v = [_to_dev_bf16(kt, c) for c in case["value_caches"]]
    want_k, want_v = [c32.copy() for _, c32 in dev_k], [c32.copy() for _, c32 in dev_v]
    reference.copy_blocks(want_k, want_v, case["block_mapping"])
    kt.copy_blocks([d for d, _ in dev_k], [d for d, _ in dev_v], kt.xp.asarray(case["block_mapping"]))
    for (d, _), w in zip(dev_k + dev_v, want_k + want_v):
        np.testing.assert_array_equal(bf16_bits_to_float32(kt.to_numpy(d)), w)


def _bf16_weight(kt, w):
    dev = kt.prepare_weight(w)
    return dev, bf16_bits_to_float32(kt.to_numpy(dev))


RN_CASES = cases_for("rms_norm")


@pytest.mark.parametrize("case_id,build", RN_CASES, ids=_ids(RN_CASES))
def test_rms_norm(kt, case_id, build):
    case = build()
    w, w32 = _bf16_weight(kt, case["weight"])
    got = kt.rms_norm(kt.xp.asarray(case["x"]), w, case["eps"])
    assert got.dtype == np.uint16
    y, bound = B.rms_norm(case["x"], w32, case["eps"])
    # the same spec: the same float64 operations in the same order, rounded once to float32
    np.testing.assert_array_equal(reference.rms_norm(case["x"], w32, case["eps"]), y.astype(np.float32))
    B.check(bf16_bits_to_float32(kt.to_numpy(got)), y, bound, case_id)


FN_CASES = cases_for("fused_add_rms_norm")


@pytest.mark.parametrize("case_id,build", FN_CASES, ids=_ids(FN_CASES))
def test_fused_add_rms_norm(kt, case_id, build):
    case = build()
    w, w32 = _bf16_weight(kt, case["weight"])
    _, want_res = reference.fused_add_rms_norm(case["x"], case["residual"], w32, case["eps"])
    xp = kt.xp
    out, res = kt.fused_add_rms_norm(xp.asarray(case["x"]), xp.asarray(case["residual"]), w, case["eps"])
    np.testing.assert_array_equal(kt.to_numpy(res), want_res)  # one float32 add: exact rounding
    y, bound = B.rms_norm(want_res, w32, case["eps"])
    B.check(bf16_bits_to_float32(kt.to_numpy(out)), y, bound, case_id)
    # in place (residual_out is residual), and the final norm over gathered rows
    r = xp.asarray(case["residual"].copy())
    out2, res2 = kt.fused_add_rms_norm(xp.asarray(case["x"]), r, w, case["eps"], residual_out=r)
    assert res2 is r
    np.testing.assert_array_equal(kt.to_numpy(r), want_res)
    np.testing.assert_array_equal(kt.to_numpy(out2), kt.to_numpy(out))
    rows = np.array([len(want_res) - 1, 0], np.int64)
    out3, none = kt.fused_add_rms_norm(xp.asarray(case["x"]), xp.asarray(case["residual"]), w, case["eps"],
                                       rows=xp.asarray(rows))
    assert none is None
    np.testing.assert_array_equal(kt.to_numpy(out3), kt.to_numpy(out)[rows])


SM_CASES = cases_for("silu_and_mul")


@pytest.mark.parametrize("case_id,build", SM_CASES, ids=_ids(SM_CASES))
def test_silu_and_mul(kt, case_id, build):
    case = build()
    got = kt.silu_and_mul(kt.xp.asarray(case["x"]))
    assert got.dtype == np.uint16
    y, bound = B.silu_and_mul(case["x"])
    B.check(bf16_bits_to_float32(kt.to_numpy(got)), y, bound, case_id)


def test_bf16_cast_kernels_round_to_nearest_even(kt):
    rng = np.random.default_rng(0)
    special = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.0e38, 1e-40,
                        # ties: exactly halfway between two bf16 values, both parities
                        np.uint32(0x3F808000).view(np.float32), np.uint32(0x3F818000).view(np.float32)],
                       dtype=np.float32)
    x = np.concatenate([special, (rng.standard_normal(5000) * 10.0 ** rng.integers(-30, 30, 5000)).astype(np.float32)])
    bits = kt.to_numpy(kt.float32_to_bf16(kt.xp.asarray(x)))
    np.testing.assert_array_equal(bits, float32_to_bf16_bits(x))
    assert bits[8] == 0x3F80 and bits[9] == 0x3F82  # ties to even
    back = kt.to_numpy(kt.bf16_to_float32(kt.xp.asarray(bits)))
    np.testing.assert_array_equal(back.view(np.uint32), bits.astype(np.uint32) << 16)
    finite = np.isfinite(x) & (np.abs(x) > 1e-37) & (np.abs(x) < 3e38)
    np.testing.assert_allclose(back[finite], x[finite], rtol=2 ** -8)


def test_prepare_weight_and_random_weight(kt):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((33, 70)).astype(np.float32)
    dev = kt.prepare_weight(w)
    assert dev.shape == w.shape and dev.dtype == np.uint16
    np.testing.assert_array_equal(kt.to_numpy(dev), float32_to_bf16_bits(w))
    # chunked conversion gives the same bits; so does a float32 array already on the device
    np.testing.assert_array_equal(kt.to_numpy(kt.prepare_weight(w, chunk_elems=100)), float32_to_bf16_bits(w))
    if kt.xp is not np:
        np.testing.assert_array_equal(kt.to_numpy(kt.prepare_weight(kt.xp.asarray(w))), float32_to_bf16_bits(w))
    # bf16 bits (a bf16 checkpoint) are taken as they are
    np.testing.assert_array_equal(kt.to_numpy(kt.prepare_weight(float32_to_bf16_bits(w))), float32_to_bf16_bits(w))
    r = kt.random_weight((64, 128), seed=3, std=0.5, mean=1.0)
    assert r.shape == (64, 128) and r.dtype == np.uint16
    vals = bf16_bits_to_float32(kt.to_numpy(r)).astype(np.float64)
    # n draws of N(1, 0.5^2): the sample mean's standard error is 0.5 / sqrt(n), the sample std's
    # 0.5 / sqrt(2 (n - 1)); 5 of them (a correct generator lands outside with probability < 1e-6)
    # plus the bf16 rounding, at most 2^-9 of each value (shifting the mean by <= 2^-9 mean|x| and
    # the std by <= 2^-9 rms(x))
    n = vals.size
    assert abs(vals.mean() - 1.0) <= 5 * 0.5 / np.sqrt(n) + 2.0 ** -9 * np.abs(vals).mean()
    assert abs(vals.std() - 0.5) <= 5 * 0.5 / np.sqrt(2 * (n - 1)) + 2.0 ** -9 * np.sqrt((vals ** 2).mean())
    np.testing.assert_array_equal(kt.to_numpy(kt.random_weight((64, 128), seed=3, std=0.5, mean=1.0)),
                                  kt.to_numpy(r))


def test_linear_and_embedding(kt):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    w = rng.standard_normal((40, 96)).astype(np.float32)
    wd = kt.prepare_weight(w)
    y, bound = B.linear(B.bf16(x), B.bf16(w))
    B.check(kt.to_numpy(kt.linear(kt.xp.asarray(x), wd)), y, bound, "float32 x")
    xb = kt.xp.asarray(float32_to_bf16_bits(x))
    out = kt.xp.zeros((5, 40), dtype=np.float32)
    assert kt.linear(xb, wd, out=out) is out
    B.check(kt.to_numpy(out), y, bound, "bf16 x into out")
    table = rng.standard_normal((50, 24)).astype(np.float32)
    ids = np.array([3, 0, 49, 3], np.int64)
    emb = kt.to_numpy(kt.embedding(kt.xp.asarray(ids), kt.prepare_weight(table)))
    np.testing.assert_array_equal(emb, bf16_bits_to_float32(float32_to_bf16_bits(table))[ids])


def test_linear_checks_the_inner_dimension(kt):
    # x [T, 96] against a weight of in_features 95: cuBLAS would read past the end of x's rows
    x = kt.xp.asarray(np.ones((3, 96), np.float32))
    w = kt.prepare_weight(np.ones((8, 95), np.float32))
    with pytest.raises(ValueError, match=r"does not match weight \(8, 95\)"):
        kt.linear(x, w)
    with pytest.raises(ValueError, match="out must be float32"):
        kt.linear(x, kt.prepare_weight(np.ones((8, 96), np.float32)), out=kt.xp.zeros((3, 7), np.float32))


def test_table_declares_bf16_storage(kt):
    # its members and call shapes: test_protocols.test_kernel_tables_conform; their behaviour: the tests above
    assert kt.name == "cuda" and kt.kv_cache_dtype == np.uint16 and kt.act_dtype == np.float32
    assert kt.matmul_input_dtype == np.uint16


def test_shared_memory_opt_in_counts_static_shared_memory():
    # the decode kernel has 256 bytes of static shared memory (block reductions) beside its dynamic
    # buffer: a dynamic request that fits the opt-in limit alone but not with the static part must
    # be refused before launch, and an accepted one must raise the kernel's dynamic limit
    fake = FakeRawKernel(static=256)
    kt = CudaKernels(np, lambda n: fake, gemm=None, smem_limit=100 * 1024)
    with pytest.raises(ValueError, match=r"needs 102300 bytes of dynamic \+ 256 of static"):
        kt._launch("k", (1,), (32,), (), shared_mem=102300)
    assert not fake.calls
    kt._launch("k", (1,), (32,), (), shared_mem=60000)
    assert fake.calls == [60000] and fake.max_dynamic_shared_size_bytes == 60000
    kt._launch("k", (1,), (32,), (), shared_mem=48 * 1024 - 100)  # fits without opt-in only if static does too
    assert fake.max_dynamic_shared_size_bytes == 60000


def test_every_kernel_is_fetched_when_the_table_is_built():
    fetched = []
    CudaKernels(np, lambda n: fetched.append(n) or FakeRawKernel(), gemm=None, kernel_names=cuda_sources.all_kernel_names())
    assert fetched == cuda_sources.all_kernel_names()
    assert "paged_attention_prefill_d128_kernel" in fetched and "sample_kernel" in fetched


@pytest.mark.skipif(ON_GPU, reason="checks the no-GPU error path")
def test_get_cuda_kernels_without_gpu_raises_clear_error(monkeypatch):
    from folio.kernels import get_kernels

    monkeypatch.delenv("FOLIO_CUDA_TABLE", raising=False)  # set in perf/gpu_check.sh's dry run
    monkeypatch.setattr(cuda_ops, "_TABLE", None)

    with pytest.raises(RuntimeError, match="device 'cuda'.*use --device cpu"):
        get_kernels("cuda")


def test_get_cuda_kernels_without_cupy_raises_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.setattr(cuda_ops, "_TABLE", None)
    monkeypatch.delenv("FOLIO_CUDA_TABLE", raising=False)
    with pytest.raises(RuntimeError, match="needs CuPy.*cupy-cuda12x or cupy-cuda13x"):
        cuda_ops.get_cuda_kernels()


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 96,
    "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 6,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "bos_token_id": 1, "eos_token_id": 2}


def test_llama_forward_on_the_cuda_table_matches_the_spec_op_by_op(kt, monkeypatch):
    # model/llama.py unchanged on the CUDA table: a tiny llama3-scaled GQA model, a 40-token prompt
    # as two prefill chunks over a shuffled block table, then two decodes with split-K partitions of
    # 16 tokens. Every kernel result of the four steps is checked against the float64 spec on the
    # inputs that kernel actually got (tests/support/cuda_shadow.py), within the bounds of
    # tests/support/cuda_bounds.py (float32 rounding, plus half a bf16 ulp wherever a kernel rounds).
    #
    # Why not the CUDA forward against the CPU forward, as this test once did: both are correct,
    # but they round activations to bf16 at many points from float32 values summed in different
    # orders; an element within a float32 rounding of a bf16 boundary lands on one side in one
    # pass and on the other in the other (2^-8 relative), and every later matrix product and
    # softmax amplifies it (weights x5 here make the softmax near-argmax). The measured gap was
    # 2e-4 of the logits' std on one Intel machine, 3.2e-3 and 0.036 on AMD ones: it depends on the
    # CPU's summation order, and no bound derived from the arithmetic is small enough to mean
    # anything. Checking each operation on its own inputs bounds what a rounding flip can do
    # (half an ulp, once) and fails on any kernel or wiring error.
    from support.cuda_shadow import SpecCheckedKernels

    from folio.model.attention_metadata import AttentionMetadata
    from folio.model.config import ModelConfig
    from folio.model.llama import LlamaForCausalLM
    from folio.model.loader import allocate_kv_caches
    from folio.model.weights import dummy_weights

    cfg = ModelConfig.from_dict(TINY_LLAMA)
    w = {n: a * 5 for n, a in dummy_weights(cfg, seed=1).items()}
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 300, 42).astype(np.int64)
    bt = rng.permutation(8)[:3].astype(np.int32)
    monkeypatch.setattr(kt, "decode_partition_size", 16)
    checked = SpecCheckedKernels(kt)
    xp = kt.xp
    model = LlamaForCausalLM(cfg, w, checked)
    caches = allocate_kv_caches(cfg, 8, 16, kt)
    for s, e in [(0, 17), (17, 40), (40, 41), (41, 42)]:
        pos = np.arange(s, e, dtype=np.int64)
        md = AttentionMetadata(
            slot_mapping=xp.asarray(bt[pos // 16].astype(np.int64) * 16 + pos % 16),
            query_start_loc=xp.asarray(np.array([0, e - s], np.int32)),
            seq_lens=xp.asarray(np.array([e], np.int32)), block_tables=xp.asarray(bt[None]),
            max_query_len=e - s, max_seq_len=e)
        logits = model.forward(xp.asarray(ids[s:e]), xp.asarray(pos), md, caches,
                               xp.asarray(np.arange(e - s, dtype=np.int64)))
        assert logits.shape == (e - s, 300) and logits.dtype == np.float32
    L = cfg.num_hidden_layers
    assert checked.checked == {"embedding": 4, "rms_norm": 4 * 1, "fused_add_rms_norm": 4 * (2 * L - 1 + 1),
                               "linear": 4 * (4 * L + 1), "rope_and_cache": 4 * L, "silu_and_mul": 4 * L,
                               "paged_attention/prefill": 2 * L, "paged_attention/decode": 2 * L}


@pytest.mark.parametrize("mask", ["-inf", "top_k"])
def test_sampler_takes_the_last_kept_token_when_the_scan_falls_short(kt, mask):
    # sample_kernel's inverse CDF: the first token whose running sum reaches u * total. With u = 1
    # the target is the whole kept mass, but `total` is a block reduction and the running sum a
    # scan, two float32 summation orders: on some rows the scan ends a few ulp below the target,
    # and as the scan groups its sums by warp, it can also first reach the target on a masked token
    # after the last kept one. The kernel must take the last kept token, never a masked one (before
    # the fix: V - 1 on 3 of the -inf rows here, a masked token on 9 of the top-k rows). Expected token, exactly: the last kept token (by index) carries the row's largest
    # probability (e = 1 of a total of at most V), so in exact arithmetic the running sum just
    # before it is total - 1, far below the target, and at it the sum is the total: it is the
    # answer of exact arithmetic, and both float32 orders agree to ~V * 2^-24 * total << 1 before it.
    rng = np.random.default_rng(11)
    R, V = 32, 1000
    logits = rng.uniform(-1.0, 0.0, (R, V)).astype(np.float32)
    params = np.zeros((R, 4), np.float32)
    params[:, 0] = 1.0      # temperature 1, top_p 1 (off), min_p 0 (off)
    params[:, 2] = 1.0
    last = rng.integers(V // 2, V - 2, R)
    for r in range(R):
        if mask == "-inf":   # a masked tail (min_tokens / stop-token masks write -inf)
            logits[r, last[r] + 1:] = -np.inf
            params[r, 3] = 1e-30  # a min_p that keeps every finite token: the scan path, not Gumbel-max
        else:                # the tail cut by top-k: k tokens at 1..2, the last of them at 3
            k = 40
            keep = np.concatenate([rng.choice(last[r], k - 1, replace=False), [last[r]]])
            logits[r, keep] = rng.uniform(1.0, 2.0, k).astype(np.float32)
            params[r, 1] = k
        logits[r, last[r]] = 3.0 if mask == "top_k" else 0.0
    # u = 1 (uniforms are in (0, 1]) on most rows, the largest double below 1 on the rest
    u = np.where(np.arange(R) % 4 == 3, np.nextafter(1.0, 0.0), 1.0)
    xp = kt.xp
    out = xp.zeros(R, dtype=np.int64)
    kt.sample(xp.asarray(logits), xp.asarray(params), xp.asarray(u), out)
    np.testing.assert_array_equal(kt.to_numpy(out), last)


def test_plain_temperature_rows_take_the_gumbel_max_in_one_pass(kt):
    # rows with temperature only (no top-k, top-p, min-p) take argmax(x / T + Gumbel noise keyed by
    # the row's uniform) (kernels/reference.py sample_gumbel), greedy rows beside them the argmax;
    # masked tokens are never picked, an all -inf row gives V - 1
    from support.cuda_bounds import check_gumbel_picks

    rng = np.random.default_rng(5)
    R, V = 20, 1000
    logits = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    logits[3, ::2] = -np.inf
    logits[4, :] = -np.inf
    logits[6, 1:] = -np.inf          # one token left: always it
    params = np.zeros((R, 4), np.float32)
    temps = rng.uniform(0.3, 2.0, R).astype(np.float32)
    greedy = np.arange(R) % 5 == 0
    params[:, 0] = np.where(greedy, 0.0, temps)
    params[:, 2] = 1.0               # top_p off
    u = 1.0 - rng.random(R)
    xp = kt.xp
    out = xp.zeros(R, dtype=np.int64)
    kt.sample(xp.asarray(logits), xp.asarray(params), xp.asarray(u), out)
    got = kt.to_numpy(out)
    rand = ~greedy
    np.testing.assert_array_equal(got[greedy], np.argmax(logits[greedy], axis=1))
    check_gumbel_picks(got[rand], logits[rand], temps[rand], u[rand].view(np.uint64))
    assert got[6] == 0
    # a row's draw depends on its logits and key only: the same rows in another order and batch
    perm = rng.permutation(R)[: R // 2]
    out2 = xp.zeros(len(perm), dtype=np.int64)
    kt.sample(xp.asarray(logits[perm]), xp.asarray(params[perm]), xp.asarray(u[perm]), out2)
    np.testing.assert_array_equal(kt.to_numpy(out2), got[perm])


def test_gumbel_spec_samples_the_softmax():
    # kernels/reference.py's noise: argmax(x / T + G) over 40,000 keys falls on each token with
    # the softmax's probability, within 5 binomial standard deviations (deterministic: fixed keys)
    from folio.kernels import reference

    x = np.array([[1.0, 0.0, -1.0, 2.0]], np.float32)
    T, N = 0.8, 40000
    keys = np.random.default_rng(0).integers(0, 2 ** 63, N, dtype=np.int64).view(np.uint64)
    picks = np.array([reference.sample_gumbel(x, np.array([T]), keys[i:i + 1])[0] for i in range(N)])
    p = np.exp(x[0] / T) / np.exp(x[0] / T).sum()
    freq = np.bincount(picks, minlength=4) / N
    np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / N))
