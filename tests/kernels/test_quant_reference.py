"""The GGUF weight types' NumPy specification (kernels/quant_reference.py) against gguf-py.

gguf-py (``gguf.quants``, llama.cpp's own Python package) is the independent expectation: every
supported type's ``dequantize`` must give the same float32 bits as ``gguf.quants.dequantize`` on
random blocks and on edge cases (zero, subnormal and extreme binary16 scales and mins, every byte
value at every position, i.e. every code); the quantizers gguf-py also has must write the same
bytes; the Q4_K quantizer (gguf-py has none) must keep each value within half its sub-block's
step, with a step no larger than the 6-bit and binary16 fields force.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from support.quant_cases import edge_blocks, random_blocks

from folio.kernels import quant_reference as qr

TYPES = sorted(qr.QUANT_TYPES.values(), key=lambda q: q.id)
IDS = [q.name for q in TYPES]


def _gguf_dequantize(blocks: np.ndarray, q: qr.QuantType) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(q.id)), dtype=np.float32)


def _assert_same_bits(a: np.ndarray, b: np.ndarray):
    # bit-identical float32 (NaNs too: a NaN must come out as the same NaN)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{diff.size} values differ, first at {diff[0]}: {a.flat[diff[0]]!r} vs {b.flat[diff[0]]!r}"


def test_layouts_match_gguf_sizes():
    # block sizes in values and bytes: llama.cpp's (gguf-py's GGML_QUANT_SIZES)
    for q in TYPES:
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(q.id)] == (q.block_values, q.block_bytes), q.name
        assert gguf.GGMLQuantizationType(q.id).name == q.name
        end = max(off + ln for _n, off, ln, _k in q.fields)
        assert end == q.block_bytes and sum(ln for _n, _o, ln, _k in q.fields) == q.block_bytes, q.name


@pytest.mark.parametrize("q", TYPES, ids=IDS)
def test_dequantize_random_blocks_match_gguf(q):
    rng = np.random.default_rng(100 + q.id)
    blocks = random_blocks(q, 3000, rng)
    _assert_same_bits(qr.dequantize(blocks, q.id), _gguf_dequantize(blocks, q))
    # rows of several blocks, and a 3-D stack of rows, keep their leading shape
    rows = blocks[:2400].reshape(40, 60 * q.block_bytes)
    got = qr.dequantize(rows, q.name)
    assert got.shape == (40, 60 * q.block_values)
    _assert_same_bits(got, _gguf_dequantize(rows, q))
    _assert_same_bits(qr.dequantize(rows.reshape(4, 10, -1), q), got.reshape(4, 10, -1))


@pytest.mark.parametrize("q", TYPES, ids=IDS)
def test_dequantize_edge_blocks_match_gguf(q):
    blocks = edge_blocks(q)
    got = qr.dequantize(blocks, q.id)
    _assert_same_bits(got, _gguf_dequantize(blocks, q))
    if q.block_values > 1:
        # zero scales (and zero mins) give zeros; the largest normal scale gives values of that size
        d_off = next(off for name, off, _ln, kind in q.fields if name == "d")
        d = blocks[:, d_off:d_off + 2].copy().view("<f2")[:, 0]
        others = [off for name, off, _ln, kind in q.fields if kind == "f16" and name != "d"]
        zero = (d == 0)
        for off in others:
            zero &= blocks[:, off:off + 2].copy().view("<f2")[:, 0] == 0
        assert zero.any() and np.all(got[zero] == 0)
        assert np.abs(got[np.abs(d) == 65504]).max() >= 65504


@pytest.mark.parametrize("q", [q for q in TYPES if q.block_values > 1], ids=lambda q: q.name)
def test_every_code_reaches_its_value(q):
    # with d = 1 and min fields 0, the values of a block are the codes' own values (times the
    # sub-block scales of the K types): every code of the type appears
    blocks = edge_blocks(q)
    fields = {name: off for name, off, _ln, kind in q.fields if kind == "f16"}
    sel = blocks[:, fields["d"]:fields["d"] + 2].copy().view("<f2")[:, 0] == 1
    for name, off in fields.items():
        if name != "d":
            sel &= blocks[:, off:off + 2].copy().view("<f2")[:, 0] == 0
    b = blocks[sel]
    y = qr.dequantize(b, q)
    if q.block_values == 32:
        codes = {"Q4_0": np.arange(-8, 8), "Q4_1": np.arange(16), "Q5_0": np.arange(-16, 16), "Q5_1": np.arange(32),
                 "Q8_0": np.arange(-128, 128)}[q.name]
        np.testing.assert_array_equal(np.unique(y), codes.astype(np.float32))
        return
    # K types: each value is (sub-block scale) x (code); every scale code and every quant code appears
    if q.name == "Q6_K":
        sc, codes = b[:, 192:208].view(np.int8).astype(np.float32), np.arange(-32, 32)
        sc_codes, per = np.arange(-128, 128), 16
    else:
        sc, _mn = qr._k_scale_min(b[:, 4:16])
        sc, codes = sc.astype(np.float32), np.arange(16 if q.name == "Q4_K" else 32)
        sc_codes, per = np.arange(64), 32
    np.testing.assert_array_equal(np.unique(sc), sc_codes.astype(np.float32))
    ys = y.reshape(b.shape[0], -1, per)
    nz = sc != 0
    q_of = ys[nz] / sc[nz][:, None]
    np.testing.assert_array_equal(np.unique(q_of), codes.astype(np.float32))
    assert np.all(ys[~nz] == 0)


def test_unsupported_types_are_refused_with_a_way_out():
    for t in (gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.IQ4_NL, 16, "iq2_xxs", 99):
        with pytest.raises(qr.UnsupportedQuantType) as e:
            qr.quant_type(t)
        msg = str(e.value)
        assert "llama-quantize" in msg and "Q4_K_M" in msg and "convert-gguf" in msg and "float32" in msg
    assert "Q2_K (GGML type 10)" in str(pytest.raises(qr.UnsupportedQuantType, qr.dequantize,
                                                      np.zeros((1, 84), np.uint8), 10).value)
    assert "IQ4_NL" in str(pytest.raises(qr.UnsupportedQuantType, qr.quant_type, 20).value)
    assert "unknown (GGML type 99)" in str(pytest.raises(qr.UnsupportedQuantType, qr.quant_type, 99).value)
    assert issubclass(qr.UnsupportedQuantType, ValueError)


def test_rows_must_be_whole_blocks():
    with pytest.raises(ValueError, match="whole number of Q4_K blocks"):
        qr.row_bytes("Q4_K", 320)
    assert qr.row_bytes("Q4_K", 512) == 288 and qr.row_bytes("Q4_1", 320) == 200
    with pytest.raises(ValueError, match="not whole Q8_0 blocks"):
        qr.dequantize(np.zeros((2, 35), np.uint8), "Q8_0")
    with pytest.raises(ValueError, match="uint8"):
        qr.dequantize(np.zeros((2, 34), np.int8), "Q8_0")
    with pytest.raises(ValueError, match="not whole Q4_0 blocks"):
        qr.quantize(np.zeros((2, 48), np.float32), "Q4_0")


def _quantize_inputs(rng, block_values):
    # rows of whole blocks: normal values, zeros, constants, one outlier per block, values at
    # rounding ties of Q8_0 (max 127: d = 1, x / d = k + 0.5), all positive, all negative, tiny, huge
    n = 4 * block_values
    rows = [rng.standard_normal(n), np.zeros(n), np.full(n, 3.25), np.where(np.arange(n) % 32 == 5, 1e4, 0.01),
            np.where(np.arange(n) % 32 == 0, 127.0, (np.arange(n) % 64) - 31.5), rng.uniform(0.5, 2.0, n),
            -rng.uniform(0.5, 2.0, n), rng.standard_normal(n) * 1e-6, rng.standard_normal(n) * 1e3]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"])
def test_quantize_matches_gguf(name):
    q = qr.quant_type(name)
    x = _quantize_inputs(np.random.default_rng(7), max(32, q.block_values))
    want = np.asarray(gguf.quants.quantize(x, gguf.GGMLQuantizationType(q.id))).view(np.uint8).reshape(x.shape[0], -1)
    np.testing.assert_array_equal(qr.quantize(x, name), want)


def test_quantize_q4_k_within_half_a_step():
    # |x - dequantize(quantize(x))| <= step / 2 for each value, step = d * sc of its sub-block as
    # stored: q = rint((x + dmin m) / step) is within half a step of (x + dmin m) / step (computed
    # in float64: relative error 2^-52, the 1 + 2^-40 below), and the float32 dequantized value is
    # the real d sc q - dmin m rounded once (both products are exact in float32): + u |y|.
    # And the step is not wasted: sc = ceil(need / d) with need = (hi + dmin m) / 15 gives
    # step < need + d, need <= (hi - min(lo, 0) + dmin) / 15.
    x = _quantize_inputs(np.random.default_rng(8), 256)
    b = qr.quantize(x, "Q4_K")
    assert b.shape == (x.shape[0], 4 * 144)
    y = qr.dequantize(b, "Q4_K")
    _assert_same_bits(y, _gguf_dequantize(b, qr.quant_type("Q4_K")))   # gguf-py reads them the same way
    blocks = b.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view("<f2").astype(np.float64)              # [n, 1]
    dmin = blocks[:, 2:4].copy().view("<f2").astype(np.float64)
    sc, mn = qr._k_scale_min(blocks[:, 4:16])
    step = d * sc                                                          # [n, 8]
    xs = x.reshape(-1, 8, 32).astype(np.float64)
    err = np.abs(xs - y.reshape(-1, 8, 32).astype(np.float64))
    bound = step[:, :, None] / 2 * (1 + 2.0 ** -40) + 2.0 ** -24 * np.abs(y.reshape(-1, 8, 32))
    assert np.all(err <= bound), float((err - bound).max())
    lo, hi = xs.min(axis=2), xs.max(axis=2)
    need_max = (hi - np.minimum(lo, 0) + dmin) / 15
    assert np.all(step <= need_max + d)
    # dmin: max(-lo) / 63 rounded up to binary16 (relative 2^-10, or one subnormal step 2^-24)
    assert np.all(dmin * 63 <= np.maximum(0, -lo).max(axis=1, keepdims=True) * (1 + 2.0 ** -9) + 63 * 2.0 ** -24)
    # exact values survive: a block of zeros stays zeros
    assert np.all(y[1] == 0)


def test_quantize_refusals():
    with pytest.raises(NotImplementedError, match="no quantizer for Q6_K"):
        qr.quantize(np.zeros((1, 256), np.float32), "Q6_K")
    with pytest.raises(ValueError, match="not finite"):
        qr.quantize(np.full((1, 32), np.inf, np.float32), "Q8_0")
    with pytest.raises(qr.UnsupportedQuantType):
        qr.quantize(np.zeros((1, 256), np.float32), "Q3_K")
