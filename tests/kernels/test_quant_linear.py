"""The CPU kernels that read GGUF-quantized weights (kernels/cpu/quant_linear.py) against the NumPy
specification (kernels/quant_reference.py, itself checked against gguf-py).

Tolerance of ``quant_linear``: the kernel decodes each weight row with the reference's float32
operations (bit-identical values: the embedding lookup below checks ``decode_row`` bit for bit on
edge blocks), so the only difference from ``x @ dequantize(w).T`` in exact arithmetic is the float32
dot product itself: K products and K - 1 additions, in whatever order LLVM's vectorised partial sums
take, each rounding at most ``u = 2^-24`` relative (fused multiply-adds round less). Higham's bound
for a dot product in any order, ``|fl(x.w) - x.w| <= gamma(K) sum_k |x_k w_k|`` with ``gamma(n) = n u
/ (1 - n u)``, plus the final rounding of the float64 reference to compare: ``numerics.dot_bound``
(``gamma(K + 1)``), against a float64 reference product of the exactly dequantized weights.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from support.numerics import dot_bound
from support.quant_cases import edge_blocks, random_weight

from folio.kernels import quant_reference as qr
from folio.kernels.cpu import quant_linear as ql
from folio.kernels.cpu import threads as cpu_threads

KERNEL_TYPES = [qr.QUANT_TYPES[t] for t in ql.KERNEL_TYPES]
IDS = [q.name for q in KERNEL_TYPES]
THREADS = [1, 2] if numba.config.NUMBA_NUM_THREADS >= 2 else [1]


def _check(x, w, q, threads, monkeypatch, parallel_always=True):
    if parallel_always:   # the parallel driver at any size (several row blocks per task)
        monkeypatch.setattr(ql, "_PARALLEL_MIN_WEIGHTS", 0)
    with cpu_threads.numba_threads(threads):
        got = ql.quant_linear(x, w, q.id)
    ref_w = qr.dequantize(w, q.id)
    want = x.astype(np.float64) @ ref_w.astype(np.float64).T
    bound = dot_bound(x, ref_w)
    assert got.dtype == np.float32 and got.shape == want.shape
    err = np.abs(got - want)
    assert np.all(err <= bound), f"max excess {(err - bound).max()} at {np.unravel_index((err - bound).argmax(), err.shape)}"
    return got


def test_kernel_types_are_the_specified_types():
    assert sorted(ql.KERNEL_TYPES) == sorted(qr.QUANT_TYPES)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("q", KERNEL_TYPES, ids=IDS)
def test_quant_linear_every_type_decode_sizes(q, threads, monkeypatch):
    # T = 1..8 (the decode sizes), N odd, two 256-value blocks per row
    rng = np.random.default_rng(1000 + q.id)
    N, K = 37, 512
    w = random_weight(q, N, K, rng)
    for T in range(1, 9):
        x = rng.standard_normal((T, K)).astype(np.float32)
        _check(x, w, q, threads, monkeypatch)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_quant_linear_random_shapes(name, threads, monkeypatch):
    q = qr.quant_type(name)
    rng = np.random.default_rng(sum(map(ord, name)))
    for N, K, T in [(1, 256, 1), (3, 768, 8), (129, 512, 5), (257, 1536, 3), (64, 2304, 7), (16, 256, 4)]:
        w = random_weight(q, N, K, rng)
        x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 10)).astype(np.float32)
        _check(x, w, q, threads, monkeypatch, parallel_always=(N % 2 == 1))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quant_linear_rows_ending_in_a_partial_group(name, monkeypatch):
    # 32-value blocks: the single-pass kernels take 8 blocks per loop trip, then the rest one by
    # one; 18, 23 and 47 blocks per row (the default model's K = 576 among them), the decode sizes
    # and one above them
    q = qr.quant_type(name)
    rng = np.random.default_rng(7000 + q.id)
    for K in (576, 736, 1504):
        w = random_weight(q, 21, K, rng)
        for T in (1, 3, 4, 6, 9):
            _check(rng.standard_normal((T, K)).astype(np.float32), w, q, THREADS[-1], monkeypatch)


@pytest.mark.parametrize("q", KERNEL_TYPES, ids=IDS)
def test_quant_linear_one_hot_tokens_read_exact_weights(q):
    # x = e_k: each output is one product 1 * w[r, k] plus exact zeros, so whatever the summation
    # order it must equal the dequantized weight bit for bit (-0.0 == 0.0): the kernels' decoded
    # values are the reference's, for one token (the single-token decode-and-dot pass) and for
    # several (decoded rows, then dot products)
    rng = np.random.default_rng(4000 + q.id)
    N, K = 19, 512
    w = random_weight(q, N, K, rng)
    ref = qr.dequantize(w, q.id)
    for k in (0, 1, 31, 32, 255, 256, 300, 511):
        for T in (1, 3):
            x = np.zeros((T, K), np.float32)
            x[:, k] = 1.0
            got = ql.quant_linear(x, w, q.id)
            for t in range(T):
                np.testing.assert_array_equal(got[t], ref[:, k])


def test_quant_linear_default_threshold_and_larger_batches(monkeypatch):
    # the unpatched plan (one task below _PARALLEL_MIN_WEIGHTS, else all threads), and T above
    # the decode sizes: decode-and-dot passes up to QUANT_GEMV_MAX_TOKENS, decoded tiles above
    rng = np.random.default_rng(5)
    q = qr.quant_type("Q4_K")
    for N, K, T in [(8, 256, 2), (300, 512, 3), (40, 512, 24), (40, 512, 33), (70, 512, 40)]:
        _check(rng.standard_normal((T, K)).astype(np.float32), random_weight(q, N, K, rng), q, THREADS[-1],
               monkeypatch, parallel_always=False)


def test_quant_linear_quantized_real_values(monkeypatch):
    # weights written by the quantizers (the path --quantization will take), against their dequantized values
    rng = np.random.default_rng(6)
    vals = (rng.standard_normal((45, 1024)) * 0.02).astype(np.float32)
    x = rng.standard_normal((4, 1024)).astype(np.float32)
    for name in ("Q8_0", "Q4_1", "Q4_K"):
        _check(x, qr.quantize(vals, name), qr.quant_type(name), THREADS[-1], monkeypatch)


def test_quant_linear_out_and_empty():
    rng = np.random.default_rng(7)
    q = qr.quant_type("Q8_0")
    w = random_weight(q, 5, 64, rng)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out = np.full((3, 5), np.nan, np.float32)
    assert ql.quant_linear(x, w, "Q8_0", out=out) is out
    np.testing.assert_array_equal(out, ql.quant_linear(x, w, q.id))
    assert ql.quant_linear(np.zeros((0, 64), np.float32), w, q.id).shape == (0, 5)
    # x as float64 and non-contiguous: converted
    xv = np.asfortranarray(x.astype(np.float64))
    np.testing.assert_array_equal(ql.quant_linear(xv, w, q.id), out)


def test_quant_linear_refusals():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 320)).astype(np.float32)
    # K = 320 is 10 whole Q4_1 blocks but not whole Q4_K super-blocks: GGUF rows are whole blocks,
    # so such a weight cannot exist; it is rejected, not padded
    with pytest.raises(ValueError, match="not a whole number of Q4_K blocks"):
        ql.quant_linear(x, np.zeros((4, 180), np.uint8), "Q4_K")
    with pytest.raises(ValueError, match="row of 320 values is 200 bytes"):
        ql.quant_linear(x, np.zeros((4, 199), np.uint8), "Q4_1")
    with pytest.raises(ValueError, match="C-contiguous uint8"):
        ql.quant_linear(x, np.zeros((4, 200), np.int8), "Q4_1")
    with pytest.raises(qr.UnsupportedQuantType, match="Q3_K"):
        ql.quant_linear(x, np.zeros((4, 200), np.uint8), 11)
    with pytest.raises(ValueError, match="out must be"):
        ql.quant_linear(x, np.zeros((4, 200), np.uint8), "Q4_1", out=np.empty((2, 5), np.float32))
    with pytest.raises(ValueError, match=r"x must be \[T, K\]"):
        ql.quant_linear(x[0], np.zeros((4, 200), np.uint8), "Q4_1")


@pytest.mark.parametrize("q", KERNEL_TYPES, ids=IDS)
def test_quant_embedding_bit_exact(q):
    # decode_row is the reference's dequantize, bit for bit, on the edge blocks (zero, subnormal,
    # largest binary16 scales and mins, every byte at every position) laid out as table rows
    blocks = edge_blocks(q)
    per_row = 8 if q.block_values == 1 else 2
    n_rows = blocks.shape[0] // per_row
    table = np.ascontiguousarray(blocks[:n_rows * per_row].reshape(n_rows, per_row * q.block_bytes))
    K = per_row * q.block_values
    ids = np.concatenate([np.arange(n_rows), [0, n_rows - 1, 0]])
    got = ql.quant_embedding(table, q.id, ids, K)
    want = qr.dequantize(table[ids], q.id)
    assert got.shape == (ids.size, K) and got.dtype == np.float32
    diff = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"{diff.size} values differ, first {got.flat[diff[0]]!r} vs {want.flat[diff[0]]!r}"


def test_quant_embedding_refusals():
    table = np.zeros((10, 20), np.uint8)
    with pytest.raises(ValueError, match="token id 10 is outside"):
        ql.quant_embedding(table, "Q4_1", np.array([1, 10]), 32)
    with pytest.raises(ValueError, match="token id -1 is outside"):
        ql.quant_embedding(table, "Q4_1", np.array([-1]), 32)
    with pytest.raises(ValueError, match="row of 64 values is 40 bytes"):
        ql.quant_embedding(table, "Q4_1", np.array([1]), 64)
    assert ql.quant_embedding(table, "Q4_1", np.array([], np.int64), 32).shape == (0, 32)


@pytest.mark.skipif(THREADS[-1] < 2, reason="needs a pool of two threads or more (NUMBA_NUM_THREADS)")
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "Q6_K", "F16"])
def test_table_linear_of_a_quantized_weight_is_quant_linear_bit_for_bit(name, activations):
    # the CPU table's linear on a QuantizedWeight (lm_head; forward.quantized_linear) runs with two
    # threads as a phase of the layer loop runs a product (the same work items and entry, in one
    # parallel region), so that a server compiles the product kernels in one signature: the same
    # rows per item and the same kernel per row as quant_linear, so the same bits; on a read-only
    # weight (a memory-mapped GGUF tensor), at token counts on each side of the paths' thresholds
    # (fused single-token, integer up to INT8_MAX_TOKENS, decode-and-dot, sgemm tiles above 32)
    from folio.kernels.cpu import forward
    from folio.kernels.cpu.table import linear
    q = qr.quant_type(name)
    rng = np.random.default_rng(40 + q.id)
    N, K = 301, 512   # N * K above _PARALLEL_MIN_WEIGHTS: the parallel path; odd N: a short last item
    w = random_weight(q, N, K, rng)
    w.setflags(write=False)
    weight = qr.QuantizedWeight(w, q.id, (N, K), activations)
    with cpu_threads.numba_threads(2):
        for T in (1, 2, 5, 16, 17, 40):
            x = rng.standard_normal((T, K)).astype(np.float32)
            want = ql.quant_linear(x, w, q.id, activations=activations)
            np.testing.assert_array_equal(linear(x, weight), want)
            out = np.full((T, N), np.nan, np.float32)
            assert linear(x, weight, out) is out
            np.testing.assert_array_equal(out, want)
    assert forward._product_region.signatures   # it ran there, not through quant_linear
    assert linear(np.zeros((0, K), np.float32), weight).shape == (0, N)
