"""The Numba CPU kernels equal the NumPy spec (kernels/reference.py) on the shared random cases.

Every tolerance is a bound derived from float32 arithmetic for any summation order
(``tests/support/numerics.py``), never a measured error: the kernels must pass on AVX2 and AVX-512
machines, whose BLAS and vectorised loops add in different orders.
"""

from __future__ import annotations

import math
import numba
import numpy as np
import pytest
from support.kernel_cases import force_parallel_kernels
from support.kernel_cases import cases_for, copy_case, paged_attention_case, rotary_embedding_case
from support.numerics import U32, U_BF16, attention_bound, bf16_attention_bound, dot_bound, exp2_rel_bound, gamma

from folio.kernels.cpu import table as cpu
from folio.kernels.cpu import attention as cpu_attention
from folio.kernels.cpu import linear as cpu_linear
from folio.kernels.cpu import simd as cpu_simd
from folio.kernels.cpu import threads as cpu_threads
from folio.kernels import get_kernels, reference

@pytest.fixture(autouse=True, params=["auto", "parallel"])
def drivers(request, monkeypatch):
    """Run every test with the size-based choice of driver, and again with the parallel drivers forced."""
    if request.param == "parallel":
        force_parallel_kernels(monkeypatch)
    return request.param


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("case_id,build", cases_for("paged_attention"), ids=_ids(cases_for("paged_attention")))
def test_paged_attention(case_id, build):
    case = build()
    want = reference.paged_attention(**case)
    got = cpu.paged_attention(**case)
    assert got.dtype == np.float32 and got.shape == want.shape
    # per output row: scores' rounding through the softmax, the sums over keys (numerics.py)
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= attention_bound(case)), float(np.max(err - attention_bound(case)))
    n_valid = int(case["query_start_loc"][-1])
    assert not got[n_valid:].any(), "padding rows must be zero"


def _growing_keys(case):
    # keys scaled up block by block (in table order), so every row's running max grows in every
    # block: the online softmax rescales its sum and output at each step
    kc = case["key_cache"].copy()
    for s in range(len(case["seq_lens"])):
        for bi in range(-(-int(case["seq_lens"][s]) // kc.shape[1])):
            kc[case["block_tables"][s, bi]] = np.abs(kc[case["block_tables"][s, bi]]) * (1 + 0.5 * bi)
    return {**case, "key_cache": kc}


# decode items (fewer than TILE_MIN_ROWS rows per KV head) at shapes and score ranges the
# shared cases (also run on the CUDA table) do not cover
DECODE_REGIMES = {
    "llama3_shapes": lambda: paged_attention_case(61, [(300, 1), (47, 3), (16, 2)], num_heads=8, num_kv_heads=2,
                                                  head_dim=128),
    "block_size_128": lambda: paged_attention_case(62, [(300, 2), (129, 1), (128, 1)], num_heads=9,
                                                   num_kv_heads=3, head_dim=64, block_size=128),
    "wide_score_range": lambda: (lambda c: {**c, "q": c["q"] * np.float32(30.0)})(
        paged_attention_case(63, [(400, 1), (90, 2)], num_heads=9, num_kv_heads=3, head_dim=64)),
    "max_grows_every_block": lambda: _growing_keys(
        paged_attention_case(64, [(333, 1), (70, 3)], num_heads=6, num_kv_heads=2, head_dim=32)),
    # the vector block code (cpu_simd) where head_dim is a multiple of its lanes: two 16-key
    # groups per block, a head_dim of 5 x 16 lanes; head_dim 24 takes it with 8 lanes only
    "head_dim_80_block_size_32": lambda: paged_attention_case(65, [(300, 1), (64, 2), (33, 1)], num_heads=6,
                                                              num_kv_heads=3, head_dim=80, block_size=32),
    "head_dim_24": lambda: paged_attention_case(66, [(200, 1), (40, 3)], num_heads=4, num_kv_heads=1, head_dim=24),
    # a KV head's rows through simd.qk16_rows (QK_ROWS at a time: 4 + 1, 4 + 4 + 2) and simd.pv_rows
    # (PV_ROWS at a time likewise): GQA 5 with 1 and 2 tokens, GQA 8 with 1
    "gqa_5": lambda: paged_attention_case(67, [(250, 1), (100, 2)], num_heads=10, num_kv_heads=2, head_dim=64),
    "gqa_8": lambda: paged_attention_case(68, [(181, 1), (64, 1)], num_heads=16, num_kv_heads=2, head_dim=64),
}


@pytest.mark.parametrize("regime", sorted(DECODE_REGIMES))
def test_paged_attention_decode_regimes(regime):
    case = DECODE_REGIMES[regime]()
    want = reference.paged_attention(**case)
    got = cpu.paged_attention(**case)
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= attention_bound(case)), float(np.max(err - attention_bound(case)))


# prefill tiles (TILE_MIN_ROWS rows or more per KV head): the vector tiles (cpu_simd's
# tile_scores / tile_pv / transpose_rows / row_max / row_exp2) over several chunks of keys, a
# chunk's last keys short of a vector (the element-wise transposition and the zeroed padding),
# row counts that are not a multiple of TILE_RB, head_dim with a single-vector remainder, a
# block size whose chunk (96 keys) is not 128; and the sgemm tiles where the vector code does
# not apply (head_dim 24 with 16 lanes, a 125-key chunk from 5-token blocks)
TILE_REGIMES = {
    "llama3_shapes_chunks": lambda: paged_attention_case(71, [(300, 300), (180, 37)], num_heads=8, num_kv_heads=2,
                                                         head_dim=128),
    "head_dim_80_rows_20": lambda: paged_attention_case(72, [(45, 5), (140, 13)], num_heads=8, num_kv_heads=2,
                                                        head_dim=80),
    "block_size_48": lambda: paged_attention_case(73, [(250, 250), (100, 30)], num_heads=6, num_kv_heads=2,
                                                  head_dim=32, block_size=48),
    "block_size_5": lambda: paged_attention_case(74, [(130, 40), (64, 64)], num_heads=6, num_kv_heads=2,
                                                 head_dim=32, block_size=5),
    "head_dim_24": lambda: paged_attention_case(75, [(150, 150), (90, 20)], num_heads=4, num_kv_heads=1, head_dim=24),
    "wide_score_range": lambda: (lambda c: {**c, "q": c["q"] * np.float32(30.0)})(
        paged_attention_case(76, [(260, 260)], num_heads=9, num_kv_heads=3, head_dim=64)),
    "max_grows_every_block": lambda: _growing_keys(
        paged_attention_case(77, [(200, 200), (90, 41)], num_heads=6, num_kv_heads=2, head_dim=32)),
    "chunk_after_long_context": lambda: paged_attention_case(78, [(700, 60), (300, 129)], num_heads=9,
                                                             num_kv_heads=3, head_dim=64),
}


@pytest.mark.parametrize("regime", sorted(TILE_REGIMES))
def test_paged_attention_tile_regimes(regime):
    case = TILE_REGIMES[regime]()
    want = reference.paged_attention(**case)
    got = cpu.paged_attention(**case)
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= attention_bound(case)), float(np.max(err - attention_bound(case)))


@numba.njit(fastmath=True)
def _tile_calls(q, ldq, rows, kt, ktoff, ldkt, nc, D, s, lds, p, ldp, n, v, voffs, acc, lda):
    cpu_simd.tile_scores(q, 2, ldq, rows, kt, ktoff, ldkt, nc, D, s, 4, lds)
    cpu_simd.tile_pv(p, 1, ldp, rows, n, v, voffs, D, acc, 5, lda)


@numba.njit(fastmath=True)
def _row_calls(src, offs, n, D, dst, ldd, s, nv, nk, init):
    cpu_simd.transpose_rows(src, offs, n, D, dst, ldd)
    mx = cpu_simd.row_max(s, 3, nv, init)
    return mx, cpu_simd.row_exp2(s, 3, nv, nk, mx)


@pytest.mark.parametrize("lanes", [1, 2, 4, 5, 8])
def test_simd_tile_code_against_numpy(lanes):
    # the prefill tiles' vector code on its own, at offsets and strides as _tile_chunks uses them
    # (head_dim = lanes x W; rows across TILE_RB blocks and the single-row remainder; key counts
    # across column groups and single vectors). Bounds for any summation order: gamma(D + 1)
    # sum |q k| per score, gamma(n + 1) (|acc| + sum |p v|) per acc element; the transposition and
    # the maximum exact; each weight within exp2's relative bound of 2^(s - m) for its float32
    # score plus the rounding of s - m, zeros from nv to nk; the sum within gamma(nk) of the
    # weights' sum. Nothing is written outside the rows' ranges.
    rng = np.random.default_rng(100 + lanes)
    W = cpu_simd.W
    D = lanes * W
    for rows in (1, 5, cpu_simd.TILE_RB, cpu_simd.TILE_RB + 1, 2 * cpu_simd.TILE_RB + 3):
        for nc in (W, 3 * W, 5 * W, 8 * W):
            ldq, ldkt, lds, ktoff = D + 3, nc + 2 * W + 5, nc + 7, W + 1
            q = rng.standard_normal(2 + rows * ldq).astype(np.float32)
            kt = rng.standard_normal(ktoff + D * ldkt).astype(np.float32)
            s = np.full(4 + rows * lds, np.nan, np.float32)
            n = nc - 3                                 # keys of P V: not a multiple of W
            ldp, lda = n + 3, D + 2
            p = rng.standard_normal(1 + rows * ldp).astype(np.float32)
            v = rng.standard_normal(200 * 3 * D).astype(np.float32)
            voffs = (rng.choice(200, n, replace=False) * 3 * D + D).astype(np.int64)
            acc0 = rng.standard_normal(5 + rows * lda).astype(np.float32)
            acc = acc0.copy()
            _tile_calls(q, ldq, rows, kt, ktoff, ldkt, nc, D, s, lds, p, ldp, n, v, voffs, acc, lda)
            Q = np.stack([q[2 + r * ldq:2 + r * ldq + D] for r in range(rows)]).astype(np.float64)
            KT = np.stack([kt[ktoff + d * ldkt:ktoff + d * ldkt + nc] for d in range(D)]).astype(np.float64)
            S = np.stack([s[4 + r * lds:4 + r * lds + nc] for r in range(rows)])
            assert np.all(np.abs(S - Q @ KT) <= gamma(D + 1) * (np.abs(Q) @ np.abs(KT)))
            written = np.zeros(s.shape, bool)
            for r in range(rows):
                written[4 + r * lds:4 + r * lds + nc] = True
            assert np.isnan(s[~written]).all()
            P = np.stack([p[1 + r * ldp:1 + r * ldp + n] for r in range(rows)]).astype(np.float64)
            V = np.stack([v[o:o + D] for o in voffs]).astype(np.float64)
            A0 = np.stack([acc0[5 + r * lda:5 + r * lda + D] for r in range(rows)]).astype(np.float64)
            A = np.stack([acc[5 + r * lda:5 + r * lda + D] for r in range(rows)])
            assert np.all(np.abs(A - (A0 + P @ V)) <= gamma(n + 1) * (np.abs(A0) + np.abs(P) @ np.abs(V)))
            untouched = np.ones(acc.shape, bool)
            for r in range(rows):
                untouched[5 + r * lda:5 + r * lda + D] = False
            assert np.array_equal(acc[untouched], acc0[untouched])
    for n in (0, W, 2 * W, 8 * W):
        src = rng.standard_normal(200 * 2 * D).astype(np.float32)
        offs = (rng.choice(200, n, replace=False) * 2 * D + D).astype(np.int64)
        ldd = n + 2 * W
        dst = np.full(D * ldd, np.nan, np.float32)
        for nv, nk in ((0, 5), (1, 1), (W - 1, W + 2), (2 * W + 3, 4 * W), (4 * W, 4 * W)):
            s = np.full(3 + (nk + W - 1) // W * W + 2, np.nan, np.float32)
            s[3:3 + nv] = rng.standard_normal(nv).astype(np.float32) * 4
            s0 = s.copy()
            mx, total = _row_calls(src, offs, n, D, dst, ldd, s, nv, nk, np.float32(-1.5))
            assert mx == max([np.float32(-1.5)] + list(s0[3:3 + nv]))
            want_w = np.exp2(s0[3:3 + nv].astype(np.float64) - mx)
            rel = exp2_rel_bound() + math.log(2.0) * np.abs(s0[3:3 + nv] - mx) * U32 + U32
            assert np.all(np.abs(s[3:3 + nv] - want_w) <= rel * want_w)
            assert not s[3 + nv:3 + nk].any() and np.isnan(s[:3]).all()
            assert abs(total - s[3:3 + nk].astype(np.float64).sum()) <= gamma(max(nk, 1)) * s[3:3 + nk].sum()
        M = dst.reshape(D, ldd)
        for j in range(n):
            assert np.array_equal(M[:, j], src[offs[j]:offs[j] + D])
        assert np.isnan(M[:, n:]).all()


@numba.njit(fastmath=True)
def _simd_calls(q, k, ks, D, s, p, n, acc, m):
    cpu_simd.qk16(q, 3, k, 5, ks, D, s, 2)
    scores = s.copy()
    cpu_simd.pv(p, 1, n, k, 5, ks, D, acc, 3)
    return scores, cpu_simd.exp2_sum16(s, 2, m)


@pytest.mark.parametrize("lanes", [1, 2, 3, 5, 8, 16])
def test_simd_block_code_against_numpy(lanes):
    # the decode attention's vector code on its own, at offsets and strides as the kernel uses
    # them: 16 dot products of head_dim = lanes x W, a weighted sum of n <= 16 rows into acc
    # (4 W columns per register block, the rest one vector at a time), 2^(s - m) and their sum.
    # Bounds for any summation order: gamma(D + 1) sum |q k| per score, gamma(n + 1) (|acc| +
    # sum |p v|) per acc element, gamma(16) of the sum of the 16 weights; each weight within
    # exp2's relative bound of 2^(s - m) for its own float32 score, plus the rounding of s - m.
    rng = np.random.default_rng(lanes)
    D = lanes * cpu_simd.W
    ks = 3 * D + 4                                   # key row stride: other heads in between
    q = rng.standard_normal(D + 3).astype(np.float32)
    k = rng.standard_normal(5 + 16 * ks).astype(np.float32)
    rows = np.stack([k[5 + o * ks:5 + o * ks + D] for o in range(16)])
    m = np.float32(0.5)
    for n in (0, 1, 7, 16):
        s = np.full(18, np.nan, np.float32)
        p = rng.standard_normal(17).astype(np.float32)
        acc0 = rng.standard_normal(D + 3).astype(np.float32)
        acc = acc0.copy()
        scores, total = _simd_calls(q, k, ks, D, s, p, n, acc, m)
        assert np.isnan(scores[:2]).all() and np.isnan(s[:2]).all()          # nothing written before soff
        exact = rows.astype(np.float64) @ q[3:].astype(np.float64)
        assert np.all(np.abs(scores[2:] - exact) <= dot_bound(q[None, 3:], rows)[0])
        want_w = np.exp2(scores[2:].astype(np.float64) - m)
        rel = exp2_rel_bound() + math.log(2.0) * np.abs(scores[2:] - m) * U32 + U32
        assert np.all(np.abs(s[2:] - want_w) <= rel * want_w)
        assert abs(total - s[2:].astype(np.float64).sum()) <= gamma(16) * s[2:].astype(np.float64).sum()
        want = acc0[3:].astype(np.float64) + p[1:1 + n].astype(np.float64) @ rows[:n].astype(np.float64)
        terms = np.abs(acc0[3:].astype(np.float64)) + np.abs(p[1:1 + n].astype(np.float64)) @ np.abs(rows[:n])
        assert np.all(np.abs(acc[3:] - want) <= gamma(n + 1) * terms)
        assert np.array_equal(acc[:3], acc0[:3])                             # nothing written before aoff


@numba.njit(fastmath=True)
def _pv_rows_call(p, ldp, rows, n, v, vs, D, acc, lda):
    cpu_simd.pv_rows(p, 1, ldp, rows, n, v, 5, vs, D, acc, 3, lda)


@numba.njit(fastmath=True)
def _pv_each_row(p, ldp, rows, n, v, vs, D, acc, lda):
    for r in range(rows):
        cpu_simd.pv(p, 1 + r * ldp, n, v, 5, vs, D, acc, 3 + r * lda)


@pytest.mark.parametrize("lanes", [1, 3, 4, 5, 8])
def test_simd_pv_rows_is_pv_row_by_row(lanes):
    # the decode's P V of a GQA group (pv_rows: each value vector loaded once for all the rows)
    # sums every element in pv's order (one fused multiply-add per key, in key order), so it
    # must give pv's bits exactly, row by row, for every row count it takes; rows outside
    # 1..PV_ROWS do nothing, and nothing outside the rows' ranges is written. pv itself is
    # checked against NumPy above (test_simd_block_code_against_numpy)
    rng = np.random.default_rng(200 + lanes)
    D = lanes * cpu_simd.W
    vs = 3 * D + 4                                   # value row stride: other heads in between
    v = rng.standard_normal(5 + 16 * vs).astype(np.float32)
    for rows in range(0, cpu_simd.PV_ROWS + 2):
        for n in (0, 1, 7, 16):
            ldp, lda = 19, D + 2
            p = rng.standard_normal(1 + max(rows, 1) * ldp).astype(np.float32)
            acc0 = np.full(3 + max(rows, 1) * lda, np.nan, np.float32)
            for r in range(rows):
                acc0[3 + r * lda:3 + r * lda + D] = rng.standard_normal(D)
            got, want = acc0.copy(), acc0.copy()
            _pv_rows_call(p, ldp, rows, n, v, vs, D, got, lda)
            if rows <= cpu_simd.PV_ROWS:
                _pv_each_row(p, ldp, rows, n, v, vs, D, want, lda)
            np.testing.assert_array_equal(got, want)


@numba.njit(fastmath=True)
def _qk16_rows_call(q, ldq, rows, k, ks, D, s, lds):
    cpu_simd.qk16_rows(q, 3, ldq, rows, k, 5, ks, D, s, 2, lds)


@numba.njit(fastmath=True)
def _qk16_each_row(q, ldq, rows, k, ks, D, s, lds):
    for r in range(rows):
        cpu_simd.qk16(q, 3 + r * ldq, k, 5, ks, D, s, 2 + r * lds)


@pytest.mark.parametrize("lanes", [1, 3, 4, 8])
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_simd_qk16_rows_is_qk16_row_by_row(lanes, cache_dtype):
    # a GQA group's scores against 16 keys (qk16_rows: each key vector loaded once for the rows)
    # are qk16's partial sums added in qk16's tree order, so they must be qk16's bits exactly,
    # for every row count it takes; rows outside 1..QK_ROWS do nothing, nothing else is written.
    # qk16 itself is checked against NumPy above (test_simd_block_code_against_numpy)
    rng = np.random.default_rng(300 + lanes)
    D = lanes * cpu_simd.W
    ks = 3 * D + 4                                   # key row stride: other heads in between
    k = rng.standard_normal(5 + 16 * ks).astype(np.float32)
    if cache_dtype == "bfloat16":
        k = (k.view(np.uint32) >> 16).astype(np.uint16)
    for rows in range(0, cpu_simd.QK_ROWS + 2):
        ldq, lds = D + 1, 21
        q = rng.standard_normal(3 + max(rows, 1) * ldq).astype(np.float32)
        got = np.full(2 + max(rows, 1) * lds, np.nan, np.float32)
        want = got.copy()
        _qk16_rows_call(q, ldq, rows, k, ks, D, got, lds)
        if rows <= cpu_simd.QK_ROWS:
            _qk16_each_row(q, ldq, rows, k, ks, D, want, lds)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case_id", ["mixed_batch_gqa3", "multi_token_decodes_gqa1", "decode_ctx203_gqa1"])
def test_paged_attention_into_a_dirty_out_buffer(case_id):
    # the result written into a caller's buffer full of NaN (the forward's workspace): every row
    # is written (or merged from zeroed key-partition rows, with the parallel drivers forced),
    # padding rows zeroed
    case = dict(cases_for("paged_attention"))[case_id]()
    want = cpu.paged_attention(**case)
    out = np.full(want.shape, np.nan, np.float32)
    got = cpu.paged_attention(**case, out=out)
    assert got is out
    np.testing.assert_array_equal(got, want)


def test_paged_attention_rejects_float64_caches():
    # the vector code reads raw float32: a float64 cache is a clear error, not wrong numbers (trial finding)
    case = paged_attention_case(1, [(64, 1), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="float32"):
        cpu.paged_attention(**{**case, "key_cache": case["key_cache"].astype(np.float64)})


def test_paged_attention_unused_table_entries_ignored():
    # same case, but garbage in block-table entries past each sequence's last block
    case = paged_attention_case(5, [(17, 3), (5, 1)])
    a = cpu.paged_attention(**case)
    bt = case["block_tables"].copy()
    bt[0, 2:] = 0
    bt[1, 1:] = case["key_cache"].shape[0] - 1
    b = cpu.paged_attention(**{**case, "block_tables": bt})
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_attention_items_cover_each_query_row_once_in_tiles_of_equal_size(group):
    # the work items of a step with prefill chunks of every length up to 3 tiles (and decodes):
    # each (token, KV head) in exactly one item; a sequence's tiles at most tile_tokens tokens
    # and equal within one token (no small remainder tile). Long prompts too: with ceil-sized
    # steps 993 tokens at GQA 4 and 1682 / 1723 at GQA 3 ended in a 1- or 2-token tile
    tile = max(1, cpu_attention.TILE_ROWS // group)
    q_lens = list(range(1, 3 * tile + 2)) + [993, 1682, 1723]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int64)
    seq_lens = np.array([ql + 7 for ql in q_lens], np.int64)
    hkv = 2
    items, _ = cpu_attention.attention_items(seq_lens, qsl, hkv, group, tile, False, 1, 16, 128)
    seen = np.zeros((qsl[-1], hkv), np.int64)
    for s, h0, h1, t0, t1, *_ in items:
        seen[t0:t1, h0:h1] += 1
    assert (seen == 1).all()
    for s, ql in enumerate(q_lens):
        sizes = sorted({t1 - t0 for s_, _, _, t0, t1, *_ in items if s_ == s})
        if ql * group >= cpu_attention.TILE_MIN_ROWS:
            assert sizes[-1] <= tile and sizes[-1] - sizes[0] <= 1, (ql, sizes)
            assert len([1 for it in items if it[0] == s]) == hkv * -(-ql // tile)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_paged_attention_never_reads_what_it_does_not_own(threads, index_dtype, drivers, monkeypatch):
    # The forward pass hands the kernel its previous layer's output as ``out=`` and a cache whose
    # unowned slots hold anything: every row must be written (partitioned decode rows are summed
    # into ``out``, so they must be cleared first), padding rows zeroed, and nothing read from
    # padding queries, slots past a context or block-table entries past it (here NaN and
    # out-of-range ids, which would poison or crash the result if touched). Single long decodes
    # (1 and 3 tokens, 2 threads: FlashDecoding key ranges) beside a short prefill chunk.
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"Numba's pool has {numba.config.NUMBA_NUM_THREADS} thread(s)")
    monkeypatch.setattr(cpu_attention, "SPLIT_MIN_THREADS", 2)  # the key-range path on 2 threads
    case = paged_attention_case(11, [(700, 1), (200, 60), (333, 3)], num_heads=2, num_kv_heads=1, block_size=8,
                                num_pad_tokens=2)
    n_valid, bs = int(case["query_start_loc"][-1]), case["key_cache"].shape[1]
    want, bound = reference.paged_attention(**case), attention_bound(case)
    owned = np.zeros(case["key_cache"].shape[:2], bool)
    bt = case["block_tables"].astype(np.int64)
    for s, ctx in enumerate(case["seq_lens"]):
        for pos in range(ctx):
            owned[bt[s, pos // bs], pos % bs] = True
        bt[s, (ctx + bs - 1) // bs:] = [-1, 10**9][s % 2]
    case["key_cache"][~owned] = np.nan
    case["value_cache"][~owned] = np.nan
    case["q"][n_valid:] = np.nan
    case["block_tables"] = bt.astype(index_dtype)  # 10**9 fits int32 too
    out = np.full(case["q"].shape, np.nan, np.float32)
    with cpu_threads.numba_threads(threads):
        got = cpu.paged_attention(**case, out=out)
        _, n_parts, _ = cpu_attention.plan(case["seq_lens"].astype(np.int64), case["query_start_loc"].astype(np.int64),
                                           2, 1, 32, bs, threads)
    assert (n_parts > 0) == (threads > 1), n_parts  # the key-range path is the one under test
    assert got is out
    assert np.all(np.abs(got[:n_valid].astype(np.float64) - want[:n_valid]) <= bound[:n_valid])
    assert np.all(got[n_valid:] == 0), "padding rows must be zero"


@pytest.mark.parametrize("case_id,build", cases_for("copy_blocks"), ids=_ids(cases_for("copy_blocks")))
def test_copy_blocks(case_id, build):
    case = build()
    want, got = copy_case(case), copy_case(case)
    reference.copy_blocks(**want)
    cpu.copy_blocks(**got)
    for a, b in zip(got["key_caches"] + got["value_caches"], want["key_caches"] + want["value_caches"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("case_id,build", cases_for("rms_norm"), ids=_ids(cases_for("rms_norm")))
def test_rms_norm(case_id, build):
    case = build()
    # the sum of squares is float64 (its error ~1e-16 relative); then three float32 roundings
    # (1/rms, x * r, * weight) against the reference's one: relative 4u per element
    np.testing.assert_allclose(cpu.rms_norm(**case), reference.rms_norm(**case), rtol=4 * U32, atol=0)


@pytest.mark.parametrize("case_id,build", cases_for("fused_add_rms_norm"), ids=_ids(cases_for("fused_add_rms_norm")))
def test_fused_add_rms_norm(case_id, build):
    case = build()
    x0, r0 = case["x"].copy(), case["residual"].copy()
    out, res = cpu.fused_add_rms_norm(**case)
    want_out, want_res = reference.fused_add_rms_norm(**case)
    # x + residual is one correctly rounded float32 addition on both sides (the reference adds
    # in float64, exact for these magnitudes, then rounds once): equal within one rounding
    np.testing.assert_allclose(res, want_res, rtol=U32, atol=0)
    # the norm of it: as test_rms_norm, plus that rounding
    np.testing.assert_allclose(out, want_out, rtol=5 * U32, atol=0)
    np.testing.assert_array_equal(case["x"], x0)
    np.testing.assert_array_equal(case["residual"], r0)


@pytest.mark.parametrize("num_padding", [0, 3])
def test_rope_and_cache(num_padding):
    # the fused pass against the spec: the rotation within _rotary_bound, the
    # values copied exactly, padding slots (-1) untouched, strided rows of a wider projection
    rng = np.random.default_rng(num_padding)
    T, H, Hkv, D, bs, nb = 37, 9, 3, 64, 16, 5
    case = rotary_embedding_case(4, num_tokens=T, num_heads=H, num_kv_heads=Hkv, head_dim=D, max_position=400)
    wide = rng.standard_normal((T, (H + 2 * Hkv) * D + 5)).astype(np.float32)
    qkv = wide[:, : (H + 2 * Hkv) * D]
    slots = rng.choice(nb * bs, size=T, replace=False).astype(np.int64)
    slots[rng.choice(T, size=num_padding, replace=False)] = -1
    kc = rng.standard_normal((nb, bs, Hkv, D)).astype(np.float32)
    vc = rng.standard_normal((nb, bs, Hkv, D)).astype(np.float32)
    kc2, vc2 = kc.copy(), vc.copy()
    pos, cs = case["positions"], case["cos_sin_cache"]
    want_q = reference.rope_and_cache(pos, qkv, cs, kc, vc, slots, H, Hkv)
    got_q = cpu.rope_and_cache(pos, qkv, cs, kc2, vc2, slots, H, Hkv)
    q_in = qkv[:, : H * D].reshape(T, H, D)
    assert np.all(np.abs(got_q.astype(np.float64) - want_q) <= _rotary_bound(q_in, pos, cs))
    k_in = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)
    k_bound = _rotary_bound(k_in, pos, cs)
    for t, slot in enumerate(slots):
        if slot >= 0:
            b, o = divmod(int(slot), bs)
            assert np.all(np.abs(kc2[b, o].astype(np.float64) - kc[b, o]) <= k_bound[t])
    np.testing.assert_array_equal(vc2, vc)
    untouched = np.ones(nb * bs, bool)
    untouched[slots[slots >= 0]] = False
    np.testing.assert_array_equal(kc2.reshape(nb * bs, -1)[untouched], kc.reshape(nb * bs, -1)[untouched])


def _rotary_bound(x, positions, cos_sin_cache):
    # out = x1 c - x2 s: two products and a difference in float32 (3 roundings, or 2 when
    # contracted to an FMA) against the reference's single final rounding, relative to
    # |x1 c| + |x2 s|
    half = x.shape[-1] // 2
    c = np.abs(cos_sin_cache[positions, :half].astype(np.float64))[:, None, :]
    s = np.abs(cos_sin_cache[positions, half:].astype(np.float64))[:, None, :]
    a1, a2 = np.abs(x[..., :half].astype(np.float64)), np.abs(x[..., half:].astype(np.float64))
    mag = np.concatenate([a1 * c + a2 * s, a2 * c + a1 * s], axis=-1)
    return 4 * U32 * mag


def test_llama3_rope_scaling_changes_only_low_frequencies():
    # independent check of the scaled frequencies used by the llama3 rotary case
    from support.kernel_cases import LLAMA3_SCALING

    plain = reference.rope_inv_freq(128, 500000.0, None)
    scaled = reference.rope_inv_freq(128, 500000.0, LLAMA3_SCALING)
    wavelen = 2 * np.pi / plain
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    # kept as they are, or divided by the factor: one float64 division, the same as here
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_array_equal(scaled[low], plain[low] / 8.0)
    mid = ~(high | low)
    assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8.0)


@pytest.mark.parametrize("case_id,build", cases_for("silu_and_mul"), ids=_ids(cases_for("silu_and_mul")))
def test_silu_and_mul(case_id, build):
    case = build()
    # e^-g = 2^(-g log2 e): the rounded argument is off by u |g| log2 e, i.e. 2^x by a relative
    # u |g|; exp2's own error; then 1 + e, g / (.), * up: 3 roundings, the reference's 1
    g = case["x"][:, : case["x"].shape[1] // 2].astype(np.float64)
    want = reference.silu_and_mul(**case).astype(np.float64)
    bound = (U32 * np.abs(g) + exp2_rel_bound() + 4 * U32) * np.abs(want)
    assert np.all(np.abs(cpu.silu_and_mul(**case) - want) <= bound)


def test_linear_embedding_prepare_weight():
    rng = np.random.default_rng(0)
    # 50 weight rows: 12 groups of 4 streams plus 2 rows on their own
    w64 = rng.standard_normal((50, 32))
    w = cpu.prepare_weight(w64[:, ::1].T.T)  # any float input -> contiguous float32
    assert w.dtype == np.float32 and w.flags.c_contiguous
    # the streaming kernel (passes of 4, 2 and 1 tokens: 1..7 cover every mix, GEMV_MAX_ROWS its
    # last size) and sgemm tiles (one more row, and more)
    G = cpu_linear.GEMV_MAX_ROWS
    for T in (1, 2, 3, 4, 5, 6, 7, 8, 9, G - 1, G, G + 1, G + 15):
        x = rng.standard_normal((T, 32)).astype(np.float32)
        y = cpu.linear(x, w)
        assert y.dtype == np.float32 and y.shape == (T, 50)
        assert np.all(np.abs(y - x.astype(np.float64) @ w.astype(np.float64).T) <= dot_bound(x, w))
    ids = np.array([3, 0, 47, 3])
    np.testing.assert_array_equal(cpu.embedding(ids, w), w[ids])
    with pytest.raises(IndexError):
        cpu.embedding(np.array([50]), w)


def test_kernel_table():
    k = get_kernels("cpu")
    assert k is cpu.CPU_KERNELS
    assert k.xp is np and k.name == "cpu"
    assert k.kv_cache_dtype == np.float32 and k.act_dtype == np.float32
    assert k.kv_cache_dtypes == {"float32": np.float32, "bfloat16": np.uint16}
    device_sampler = {"gumbel_noise", "sample_gumbel"}   # the CUDA table's sampler's spec (reference.py)
    for name in [n for n in reference.__all__ if n not in device_sampler] + ["linear", "embedding", "prepare_weight"]:
        assert callable(getattr(k, name)), name


# ----------------------------------------------------------------------------------------------
# a bfloat16 KV cache (--kv-cache-dtype bfloat16: uint16 bit patterns, kernels/cpu/kv_dtype.py)
# ----------------------------------------------------------------------------------------------


def _bf16_case(case):
    # the case's float32 caches rounded to bfloat16 bits (the cache a bfloat16 engine holds), and
    # the same values widened back to float32 (what the kernels compute with)
    k16, v16 = (reference.float32_to_bf16_bits(case[n]) for n in ("key_cache", "value_cache"))
    return ({**case, "key_cache": k16, "value_cache": v16},
            {**case, "key_cache": reference.bf16_bits_to_float32(k16),
             "value_cache": reference.bf16_bits_to_float32(v16)})


def test_bf16_rounding_of_the_reference_is_round_to_nearest_even():
    # the spec's rounding against the definition, independently: of the two bfloat16 values around
    # x (its truncation t and t + 1 ulp), the nearer one, the even one on a tie; NaN stays NaN,
    # infinities and zeros stay themselves, and the relative error is at most U_BF16 = 2^-8
    rng = np.random.default_rng(3)
    x = np.concatenate([(rng.standard_normal(20000) * 10.0 ** rng.integers(-30, 30, 20000)).astype(np.float32),
                        # ties: the dropped half is exactly 0x8000, with an even and an odd kept half
                        (np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000], np.uint32)).view(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)])
    got = reference.float32_to_bf16_bits(x)
    back = reference.bf16_bits_to_float32(got).astype(np.float64)
    finite = np.isfinite(x)
    t = (x.view(np.uint32) >> 16).astype(np.uint16)
    with np.errstate(invalid="ignore"):   # the non-finite inputs, checked apart
        lo = reference.bf16_bits_to_float32(t).astype(np.float64)
        hi = reference.bf16_bits_to_float32(t + np.uint16(1)).astype(np.float64)   # further from zero
        x64 = x.astype(np.float64)
        d_lo, d_hi = np.abs(x64 - lo), np.abs(x64 - hi)
        want = np.where(d_lo < d_hi, t, np.where(d_hi < d_lo, t + np.uint16(1), np.where(t % 2 == 0, t, t + np.uint16(1))))
    m = finite & np.isfinite(hi)
    np.testing.assert_array_equal(got[m], want[m])
    assert got[-3] == 0x7F80 and got[-2] == 0xFF80 and np.isnan(back[-1])   # +-inf, NaN
    assert got[-4] == 0x8000 and got[-5] == 0
    m = finite & np.isfinite(back)
    assert np.all(np.abs(back[m] - x64[m]) <= U_BF16 * np.abs(x64[m]))
    # the kernels' own rounding (kv_dtype.from_f32, as rope_and_cache stores the values) is the
    # spec's, bit for bit (the keys are rotated first: test_rope_and_cache_bf16 bounds them)
    n = x.size // 8 * 8
    H, Hkv, D = 2, 2, 4
    qkv = np.zeros((n // (Hkv * D), (H + 2 * Hkv) * D), np.float32)
    qkv[:, (H + Hkv) * D:] = x[:n].reshape(-1, Hkv * D)
    kc = np.zeros((qkv.shape[0], 1, Hkv, D), np.uint16)
    vc = np.zeros_like(kc)
    cs = reference.rope_cos_sin_cache(reference.rope_inv_freq(D, 10000.0), 1)
    rows = np.arange(qkv.shape[0], dtype=np.int64)
    cpu.rope_and_cache(np.zeros_like(rows), qkv, cs, kc, vc, rows, H, Hkv)
    np.testing.assert_array_equal(vc.reshape(-1), got[:n])


_BF16_ATTENTION_CASES = ([(f"shared_{i}", b) for i, b in cases_for("paged_attention")]
                         + [(f"decode_{r}", DECODE_REGIMES[r]) for r in sorted(DECODE_REGIMES)]
                         + [(f"tile_{r}", TILE_REGIMES[r]) for r in sorted(TILE_REGIMES)])


@pytest.mark.parametrize("case_id,build", _BF16_ATTENTION_CASES, ids=_ids(_BF16_ATTENTION_CASES))
def test_paged_attention_bf16_cache(case_id, build):
    # the kernel over a bfloat16 cache against the spec over the same cache (which reads it
    # widened to float32): the widening is exact and every operation after it is float32, so the
    # float32 bound holds, computed over the widened values (decode blocks in vector code, their
    # scalar loops, vector and sgemm tiles, key partitions with the parallel drivers forced)
    case16, widened = _bf16_case(build())
    want = reference.paged_attention(**case16)
    got = cpu.paged_attention(**case16)
    assert np.isfinite(got).all()
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= attention_bound(widened)), float(np.max(err - attention_bound(widened)))
    assert not got[int(case16["query_start_loc"][-1]):].any(), "padding rows must be zero"


@pytest.mark.parametrize("case_id", ["mixed_batch_gqa3", "multi_token_decodes_gqa1", "chunk_50_after_203"])
def test_paged_attention_bf16_cache_against_float32(case_id):
    # what storing in bfloat16 costs: the kernel over the rounded cache against the exact
    # attention over the float32 one, within the float32 bound (over the widened values) plus
    # the effect of rounding each key and value once (relative 2^-8; numerics.bf16_attention_bound)
    case = dict(cases_for("paged_attention"))[case_id]()
    case16, widened = _bf16_case(case)
    want = reference.paged_attention(**case)
    got = cpu.paged_attention(**case16)
    bound = attention_bound(widened) + bf16_attention_bound(case) + U32 * np.abs(want).max()
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), float(np.max(err - bound))
    assert err.max() > 0   # the rounding is there (the comparison is not of two float32 runs)


def test_rope_and_cache_bf16():
    # the fused pass over a bfloat16 cache: values stored as the spec rounds them (bit for bit),
    # keys within the rotation's float32 bound and then one rounding to bfloat16 (2^-8 relative,
    # of the kernel's float32 key), queries as over a float32 cache; padding slots untouched
    rng = np.random.default_rng(9)
    T, H, Hkv, D, bs, nb = 37, 9, 3, 64, 16, 5
    case = rotary_embedding_case(4, num_tokens=T, num_heads=H, num_kv_heads=Hkv, head_dim=D, max_position=400)
    qkv = rng.standard_normal((T, (H + 2 * Hkv) * D)).astype(np.float32)
    slots = rng.choice(nb * bs, size=T, replace=False).astype(np.int64)
    slots[[3, 20]] = -1
    kc = reference.float32_to_bf16_bits(rng.standard_normal((nb, bs, Hkv, D)).astype(np.float32))
    vc = reference.float32_to_bf16_bits(rng.standard_normal((nb, bs, Hkv, D)).astype(np.float32))
    kc2, vc2 = kc.copy(), vc.copy()
    pos, cs = case["positions"], case["cos_sin_cache"]
    want_q = reference.rope_and_cache(pos, qkv, cs, kc, vc, slots, H, Hkv)
    got_q = cpu.rope_and_cache(pos, qkv, cs, kc2, vc2, slots, H, Hkv)
    np.testing.assert_array_equal(got_q, cpu.rope_and_cache(pos, qkv, cs, np.zeros((nb, bs, Hkv, D), np.float32),
                                                            np.zeros((nb, bs, Hkv, D), np.float32), slots, H, Hkv))
    assert np.all(np.abs(got_q.astype(np.float64) - want_q) <= _rotary_bound(qkv[:, :H * D].reshape(T, H, D), pos, cs))
    np.testing.assert_array_equal(vc2, vc)
    _, k_exact = reference.rotary_embedding(pos, qkv[:, :H * D].reshape(T, H, D),
                                            qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D), cs)
    k_bound = _rotary_bound(qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D), pos, cs)
    got_k = reference.bf16_bits_to_float32(kc2).astype(np.float64)
    for t, slot in enumerate(slots):
        if slot >= 0:
            b, o = divmod(int(slot), bs)
            exact = k_exact[t].astype(np.float64)
            assert np.all(np.abs(got_k[b, o] - exact) <= k_bound[t] + U_BF16 * (np.abs(exact) + k_bound[t]))
    untouched = np.ones(nb * bs, bool)
    untouched[slots[slots >= 0]] = False
    np.testing.assert_array_equal(kc2.reshape(nb * bs, -1)[untouched], kc.reshape(nb * bs, -1)[untouched])


def test_copy_blocks_bf16():
    case = cases_for("copy_blocks")[0][1]()
    for name in ("key_caches", "value_caches"):
        case[name] = [reference.float32_to_bf16_bits(c) for c in case[name]]
    want, got = copy_case(case), copy_case(case)
    reference.copy_blocks(**want)
    cpu.copy_blocks(**got)
    for a, b in zip(got["key_caches"] + got["value_caches"], want["key_caches"] + want["value_caches"]):
        assert a.dtype == np.uint16
        np.testing.assert_array_equal(a, b)


def test_kv_cache_dtype_errors():
    # caches of two dtypes, or of a dtype the kernels do not read, are clear errors
    case = paged_attention_case(1, [(40, 1)], num_heads=4, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="one dtype"):
        cpu.paged_attention(**{**case, "value_cache": reference.float32_to_bf16_bits(case["value_cache"])})
    with pytest.raises(ValueError, match="uint16"):
        cpu.paged_attention(**{**case, "key_cache": case["key_cache"].astype(np.float16),
                               "value_cache": case["value_cache"].astype(np.float16)})
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        reference.kv_cache_values(case["key_cache"].astype(np.float16))
