"""NumPy specification of the GGUF weight types folio reads: block layouts, ``dequantize``, ``quantize``.

A GGUF tensor of shape ``[N, K]`` (``K`` the fastest-varying dimension, ``ne0`` in llama.cpp's
words) is stored as ``N`` rows of ``K / block_values`` blocks, each block ``block_bytes`` bytes laid
out exactly as llama.cpp's C structs (``ggml-common.h``: ``block_q4_0`` ... ``block_q6_K``, packed, no
padding, little-endian). A row must be a whole number of blocks: GGUF cannot store a ``K`` that is
not a multiple of the block size, and neither do these functions.

The types (``QUANT_TYPES``), with ``f16`` an IEEE binary16 field and ``q`` the integer quant of a value:

======  ======  =====  =================================================================================
type    values  bytes  layout and value
======  ======  =====  =================================================================================
F32     1       4      float32
F16     1       2      binary16
BF16    1       2      bfloat16 (the high half of a float32)
Q4_0    32      18     ``d f16, qs[16]``; value ``j < 16`` in the low nibble of ``qs[j]``, ``j + 16`` in its
                       high nibble; ``(q - 8) * d``
Q4_1    32      20     ``d f16, m f16, qs[16]`` (nibbles as Q4_0); ``d * q + m``
Q5_0    32      22     ``d f16, qh u32, qs[16]``; bit 4 of value ``j`` is bit ``j`` of ``qh``; ``(q - 16) * d``
Q5_1    32      24     ``d f16, m f16, qh u32, qs[16]``; ``d * q + m``
Q8_0    32      34     ``d f16, qs int8[32]``; ``q * d``
Q4_K    256     144    ``d f16, dmin f16, scales[12], qs[128]``: 8 sub-blocks of 32, each with a 6-bit scale
                       ``sc`` and min ``m`` packed in ``scales`` (``_k_scale_min``); 64 values per 32 bytes
                       of ``qs``: sub-block ``2c`` in the low nibbles of ``qs[32c:32c+32]``, ``2c + 1`` in
                       the high ones; ``(d * sc) * q - (dmin * m)``
Q5_K    256     176    ``d, dmin, scales[12], qh[32], qs[128]``: as Q4_K, bit 4 of value ``l`` of sub-block
                       ``s`` is bit ``s`` of ``qh[l]``
Q6_K    256     210    ``ql[128], qh[64], scales int8[16], d f16``: 16 sub-blocks of 16 values (the scale of
                       value ``i`` is ``scales[i // 16]``); in each half ``h`` (128 values, ``ql[64h:]``,
                       ``qh[32h:]``) value ``32g + l`` has low bits from ``ql[l + 32 (g & 1)]`` (low
                       nibble for ``g < 2``, high for ``g >= 2``) and high bits ``(qh[l] >> 2g) & 3``;
                       ``(d * sc) * (q - 32)``
======  ======  =====  =================================================================================

``dequantize`` evaluates each value with the float32 operations, in the order, of llama.cpp's
``dequantize_row_*`` (every product of a binary16 field and a small integer is exact in float32;
the one rounding step is the final add, or for Q6_K the second product), so its results are
bit-identical to ``gguf.quants.dequantize`` (gguf-py) and to llama.cpp.

``quantize`` writes blocks: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 with llama.cpp's reference quantizers
(``quantize_row_*_ref``: bit-identical to gguf-py's ``quantize``), and Q4_K with a simpler one than
llama.cpp's (which searches scales iteratively, ``make_qkx2_quants``): per sub-block the min and the
step are rounded *up* to what the 6-bit fields and binary16 super-scales hold, so every value lies in
the representable range and is off by at most half its sub-block's step.

A type outside this list (the IQ types, Q2_K, Q3_K, TQ, MXFP4, ...) is refused with
``UnsupportedQuantType``, which names the type and the ways out.

Sources: llama.cpp ``ggml/src/ggml-common.h`` (the block structs) and ``ggml/src/ggml-quants.c``
(``dequantize_row_*``, ``quantize_row_*_ref``, ``get_scale_min_k4``); the k-quants description of
llama.cpp PR 1684 (Kawrakow, 2023).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["QuantType", "QuantizedWeight", "QUANT_TYPES", "GGML_TYPE_NAMES", "UnsupportedQuantType", "quant_type", "row_bytes",
           "dequantize", "quantize", "QUANTIZERS", "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
           "Q4_K", "Q5_K", "Q6_K"]

# GGML type ids (ggml.h, enum ggml_type), as stored in a GGUF tensor's info
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q4_K, Q5_K, Q6_K = 12, 13, 14
BF16 = 30

GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 4: "Q4_2", 5: "Q4_3", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
    18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
"""Every GGML type id folio knows a name for (ggml.h), supported or not, for error messages."""


class QuantType(NamedTuple):
    """One GGUF weight type: ``id`` (GGML type id), ``name``, ``block_values`` (values per block),
    ``block_bytes`` (bytes per block) and ``fields`` (``(name, byte offset, byte length, kind)`` of
    each field of a block, ``kind`` one of ``f16``, ``bf16``, ``f32``, ``u8``, ``i8``, ``u32``)."""
    id: int
    name: str
    block_values: int
    block_bytes: int
    fields: tuple


QUANT_TYPES = {t.id: t for t in (
    QuantType(F32, "F32", 1, 4, (("value", 0, 4, "f32"),)),
    QuantType(F16, "F16", 1, 2, (("value", 0, 2, "f16"),)),
    QuantType(BF16, "BF16", 1, 2, (("value", 0, 2, "bf16"),)),
    QuantType(Q4_0, "Q4_0", 32, 18, (("d", 0, 2, "f16"), ("qs", 2, 16, "u8"))),
    QuantType(Q4_1, "Q4_1", 32, 20, (("d", 0, 2, "f16"), ("m", 2, 2, "f16"), ("qs", 4, 16, "u8"))),
    QuantType(Q5_0, "Q5_0", 32, 22, (("d", 0, 2, "f16"), ("qh", 2, 4, "u32"), ("qs", 6, 16, "u8"))),
    QuantType(Q5_1, "Q5_1", 32, 24, (("d", 0, 2, "f16"), ("m", 2, 2, "f16"), ("qh", 4, 4, "u32"),
                                     ("qs", 8, 16, "u8"))),
    QuantType(Q8_0, "Q8_0", 32, 34, (("d", 0, 2, "f16"), ("qs", 2, 32, "i8"))),
    QuantType(Q4_K, "Q4_K", 256, 144, (("d", 0, 2, "f16"), ("dmin", 2, 2, "f16"), ("scales", 4, 12, "u8"),
                                       ("qs", 16, 128, "u8"))),
    QuantType(Q5_K, "Q5_K", 256, 176, (("d", 0, 2, "f16"), ("dmin", 2, 2, "f16"), ("scales", 4, 12, "u8"),
                                       ("qh", 16, 32, "u8"), ("qs", 48, 128, "u8"))),
    QuantType(Q6_K, "Q6_K", 256, 210, (("ql", 0, 128, "u8"), ("qh", 128, 64, "u8"), ("scales", 192, 16, "i8"),
                                       ("d", 208, 2, "f16"))),
)}
"""The supported types by GGML type id."""

_WAY_OUT = ("re-quantize the file to a supported type with llama.cpp's llama-quantize (e.g. "
            "`llama-quantize --allow-requantize IN.gguf OUT.gguf Q4_K_M`), or import it as float32 with "
            "`folio convert-gguf IN.gguf OUT_DIR` (--dtype float32)")


class UnsupportedQuantType(ValueError):
    """A GGUF tensor type folio does not read; the message names it, the supported types and the ways out."""


def quant_type(t) -> QuantType:
    """The ``QuantType`` of ``t``: a GGML type id (int or an ``IntEnum`` such as
    ``gguf.GGMLQuantizationType``), a name (``"Q4_K"``, case-insensitive) or a ``QuantType``.

    Raises:
        UnsupportedQuantType: a type outside ``QUANT_TYPES`` (named, with the supported types and the
            ways out: re-quantize with llama-quantize, or import as float32).
    """
    if isinstance(t, QuantType):
        return t
    if isinstance(t, str):
        by_name = {q.name: q for q in QUANT_TYPES.values()}
        if t.upper() in by_name:
            return by_name[t.upper()]
        label = repr(t)
    else:
        i = int(t)
        if i in QUANT_TYPES:
            return QUANT_TYPES[i]
        label = f"{GGML_TYPE_NAMES.get(i, 'unknown')} (GGML type {i})"
    supported = ", ".join(q.name for q in QUANT_TYPES.values())
    raise UnsupportedQuantType(f"tensor type {label} is not supported (folio reads {supported}); {_WAY_OUT}")


def row_bytes(t, k: int) -> int:
    """Bytes of one row of ``k`` values of type ``t``.

    Raises:
        UnsupportedQuantType: see ``quant_type``.
        ValueError: ``k`` is not a whole number of blocks (GGUF rows are whole blocks).
    """
    q = quant_type(t)
    if k % q.block_values:
        raise ValueError(f"a row of {k} values is not a whole number of {q.name} blocks of {q.block_values}")
    return k // q.block_values * q.block_bytes


# --- dequantize ----------------------------------------------------------------------------------

def _f16(b: np.ndarray, off: int) -> np.ndarray:
    # binary16 field at byte ``off`` of each block -> float32 [n, 1] (exact)
    return np.ascontiguousarray(b[:, off:off + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    # [n, 16] bytes -> [n, 32] quants: the low nibbles are values 0..15, the high ones 16..31
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _qh_bits(b: np.ndarray, off: int) -> np.ndarray:
    # Q5_0 / Q5_1: the uint32 at ``off``, little-endian; bit j is bit 4 of value j -> [n, 32] of 0 / 16
    qh = np.ascontiguousarray(b[:, off:off + 4]).view("<u4")
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 6-bit scale and min of each of the 8 sub-blocks from the 12 bytes
    ``scales [n, 12]`` (llama.cpp ``get_scale_min_k4``): sub-blocks 0..3 in the low 6 bits of bytes
    0..3 (scales) and 4..7 (mins); sub-blocks 4..7 in the nibbles of bytes 8..11 (low: scale, high:
    min) with their top 2 bits in the top bits of bytes 0..3 (scales) and 4..7 (mins)."""
    s = scales.astype(np.uint8)
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def _deq_blocks(b: np.ndarray, q: QuantType) -> np.ndarray:
    # b: [n, block_bytes] uint8 -> [n, block_values] float32
    n, f32 = b.shape[0], np.float32
    if q.id == F32:
        return np.ascontiguousarray(b).view("<f4").copy()
    if q.id == F16:
        return np.ascontiguousarray(b).view("<f2").astype(f32)
    if q.id == BF16:
        return (np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16).view(f32)
    if q.id == Q4_0:
        return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.int8) - 8).astype(f32)
    if q.id == Q4_1:
        return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(f32) + _f16(b, 2)
    if q.id == Q5_0:
        qv = _nibbles(b[:, 6:22]) | _qh_bits(b, 2)
        return _f16(b, 0) * (qv.astype(np.int8) - 16).astype(f32)
    if q.id == Q5_1:
        qv = _nibbles(b[:, 8:24]) | _qh_bits(b, 4)
        return _f16(b, 0) * qv.astype(f32) + _f16(b, 2)
    if q.id == Q8_0:
        return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(f32)
    if q.id in (Q4_K, Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scale_min(b[:, 4:16])
        qs = b[:, 16:144] if q.id == Q4_K else b[:, 48:176]
        # sub-block 2c: low nibbles of qs[32c : 32c + 32]; 2c + 1: the high ones -> [n, 8, 32]
        chunks = qs.reshape(n, 4, 32)
        qv = np.stack([chunks & 0x0F, chunks >> 4], axis=2).reshape(n, 8, 32)
        if q.id == Q5_K:
            qh = b[:, 16:48]
            qv = qv | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        d1 = (d * sc.astype(f32))[:, :, None]      # exact: 11-bit significand x 6-bit integer
        m1 = (dmin * mn.astype(f32))[:, :, None]
        return (d1 * qv.astype(f32) - m1).reshape(n, 256)
    if q.id == Q6_K:
        ql, qh = b[:, 0:128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
        sc = b[:, 192:208].view(np.int8).astype(f32)
        d = _f16(b, 208)
        # value 32g + l of half h: low 4 bits from ql[h, l + 32 (g & 1)] (nibble g >> 1), high 2 from
        # qh[h, l] >> 2g
        lo = np.stack([ql[:, :, :32] & 0x0F, ql[:, :, 32:] & 0x0F, ql[:, :, :32] >> 4, ql[:, :, 32:] >> 4], axis=2)
        hi = (qh[:, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
        qv = ((lo | (hi << 4)).astype(np.int8) - 32).reshape(n, 16, 16)
        return ((d * sc)[:, :, None] * qv.astype(f32)).reshape(n, 256)
    raise AssertionError(q)  # pragma: no cover - QUANT_TYPES and this function list the same types


def dequantize(data: np.ndarray, t) -> np.ndarray:
    """Values of GGUF-laid-out ``data`` of type ``t``.

    Args:
        data: ``uint8 [..., row_bytes]``, each row a whole number of blocks (a tensor's bytes as
            gguf-py's ``ReaderTensor.data`` gives them, or one row).
        t: the type (see ``quant_type``).

    Returns:
        float32 ``[..., row_bytes / block_bytes * block_values]``, bit-identical to llama.cpp's
        ``dequantize_row_*`` and to ``gguf.quants.dequantize``.

    Raises:
        UnsupportedQuantType: ``t`` is not a supported type.
        ValueError: ``data`` is not uint8, or its rows are not whole blocks.
    """
    q = quant_type(t)
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise ValueError(f"{q.name} data must be uint8 bytes, got {data.dtype}")
    if data.ndim == 0 or data.shape[-1] % q.block_bytes:
        raise ValueError(f"rows of {data.shape[-1] if data.ndim else 0} bytes are not whole {q.name} blocks "
                         f"of {q.block_bytes} bytes")
    lead, nb = data.shape[:-1], data.shape[-1] // q.block_bytes
    blocks = np.ascontiguousarray(data).reshape(-1, q.block_bytes)
    return _deq_blocks(blocks, q).reshape(*lead, nb * q.block_values)


# --- quantize ------------------------------------------------------------------------------------

def _round_half_away(v: np.ndarray) -> np.ndarray:
    # C roundf: nearest, ties away from zero (the fractional part of a float is exact)
    a = np.abs(v)
    whole = np.trunc(a)
    return np.sign(v) * (whole + (a - whole >= 0.5))


def _to_f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype("<f2")).view(np.uint8)


def _pack_nibbles(qv: np.ndarray) -> np.ndarray:
    # [n, 32] quants (0..15 in the low 4 bits) -> [n, 16]: value j low, j + 16 high
    return ((qv[:, :16] & 0x0F) | (qv[:, 16:] << 4)).astype(np.uint8)


def _pack_qh(qv: np.ndarray) -> np.ndarray:
    # [n, 32] 5-bit quants -> [n, 4]: bit 4 of value j at bit j of a little-endian uint32
    bits = ((qv.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    return np.ascontiguousarray(bits.sum(axis=1, dtype=np.uint32).astype("<u4")[:, None]).view(np.uint8)


def _quantize_type0(x: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray]:
    # Q4_0 (half = 8) / Q5_0 (16), quantize_row_q4_0_ref: d = (the value of largest magnitude, the
    # first one) / -half; q = min(2 half - 1, trunc(x / d + half + 0.5))
    f32 = np.float32
    imax = np.argmax(np.abs(x), axis=1)
    vmax = x[np.arange(x.shape[0]), imax][:, None]
    d = vmax / f32(-half)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, f32(0), f32(1) / d).astype(f32)
    qv = np.minimum(2 * half - 1, np.trunc(x * inv + f32(half + 0.5)).astype(np.int8)).astype(np.uint8)
    return d.astype(f32), qv


def _quantize_type1(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # Q4_1 (levels = 15) / Q5_1 (31), quantize_row_q4_1_ref: d = (max - min) / levels,
    # q = min(levels, trunc((x - min) / d + 0.5)), stored min = min
    f32 = np.float32
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / f32(levels)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, f32(0), f32(1) / d).astype(f32)
    qv = np.minimum(levels, np.trunc((x - lo) * inv + f32(0.5)).astype(np.int8)).astype(np.uint8)
    return d.astype(f32), lo, qv


def _f16_up(v: np.ndarray) -> np.ndarray:
    # the smallest binary16 >= v (v >= 0, finite, below 65504), as float64
    h = v.astype(np.float16)
    h = np.where(h.astype(np.float64) < v, np.nextafter(h, np.float16(np.inf)), h)
    return h.astype(np.float64)


def _quantize_q4_k(x: np.ndarray) -> np.ndarray:
    # [n, 256] float32 -> [n, 144]. Per sub-block s (32 values, lo..hi): the min offset -lo (at least
    # 0, as llama.cpp) is rounded up to dmin * m_s (m_s = ceil(-lo / dmin), dmin = the binary16 at or
    # above max(-lo) / 63); the step up to d * sc_s >= (hi + dmin m_s) / 15 likewise. Then every
    # x + dmin m_s lies in [0, 15 d sc_s], and q = round((x + dmin m_s) / (d sc_s)) is within half a
    # step of it: |x - dequantized| <= d sc_s / 2 (+ the final float32 rounding).
    n = x.shape[0]
    v = x.astype(np.float64).reshape(n, 8, 32)
    neg_lo = np.maximum(0.0, -v.min(axis=2))                           # [n, 8]
    hi = v.max(axis=2)
    slack = 1 + 2.0 ** -20   # keeps the ratios below 63 after division's rounding
    dmin = _f16_up(neg_lo.max(axis=1, keepdims=True) / 63 * slack)    # [n, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.where(dmin > 0, np.ceil(neg_lo / dmin), 0).astype(np.int64)
    off = dmin * m                                                     # exact: 11 x 6 bits
    need = np.maximum(0.0, (hi + off) / 15)                            # step each sub-block needs
    d = _f16_up(need.max(axis=1, keepdims=True) / 63 * slack)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d > 0, np.ceil(need / d), 0).astype(np.int64)
        step = d * sc
        qv = np.where(step[:, :, None] > 0, np.rint((v + off[:, :, None]) / step[:, :, None]), 0)
    qv = np.clip(qv, 0, 15).astype(np.uint8)
    assert sc.max(initial=0) <= 63 and m.max(initial=0) <= 63
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    scales = np.empty((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    chunks = qv.reshape(n, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_to_f16_bytes(d), _to_f16_bytes(dmin), scales, qs], axis=1)


def _quantize_blocks(x: np.ndarray, q: QuantType) -> np.ndarray:
    # x: [n, block_values] float32 -> [n, block_bytes] uint8
    if q.id == F32:
        return np.ascontiguousarray(x.astype("<f4")).view(np.uint8)
    if q.id == F16:
        return _to_f16_bytes(x)
    if q.id == BF16:  # round to nearest even; NaN kept quiet (ggml_compute_fp32_to_bf16)
        u = np.ascontiguousarray(x).view(np.uint32).astype(np.uint64)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        r = np.where(nan, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        return np.ascontiguousarray(r.astype("<u2")).view(np.uint8)
    if q.id == Q8_0:  # quantize_row_q8_0_ref: d = max|x| / 127, q = roundf(x / d)
        d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
        with np.errstate(divide="ignore"):
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
        qv = _round_half_away(x * inv).astype(np.int8).view(np.uint8)
        return np.concatenate([_to_f16_bytes(d), qv], axis=1)
    if q.id in (Q4_0, Q5_0):
        d, qv = _quantize_type0(x, 8 if q.id == Q4_0 else 16)
        parts = [_to_f16_bytes(d)] + ([_pack_qh(qv)] if q.id == Q5_0 else []) + [_pack_nibbles(qv)]
        return np.concatenate(parts, axis=1)
    if q.id in (Q4_1, Q5_1):
        d, lo, qv = _quantize_type1(x, 15 if q.id == Q4_1 else 31)
        parts = [_to_f16_bytes(d), _to_f16_bytes(lo)] + ([_pack_qh(qv)] if q.id == Q5_1 else []) + [_pack_nibbles(qv)]
        return np.concatenate(parts, axis=1)
    if q.id == Q4_K:
        return _quantize_q4_k(x)
    raise NotImplementedError(f"no quantizer for {q.name} (have: {', '.join(QUANTIZERS)})")


QUANTIZERS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K")
"""The types ``quantize`` writes."""


def quantize(values: np.ndarray, t) -> np.ndarray:
    """GGUF blocks of type ``t`` holding ``values``.

    Args:
        values: float32 ``[..., K]`` (other float dtypes are converted), ``K`` a whole number of blocks.
        t: one of ``QUANTIZERS``.

    Returns:
        uint8 ``[..., K / block_values * block_bytes]``: for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16 and BF16
        bit-identical to llama.cpp's reference quantizers and gguf-py's ``quantize``; for Q4_K, each
        value within half its sub-block's step of the input (module docstring).

    Raises:
        UnsupportedQuantType: ``t`` is not a supported type.
        NotImplementedError: a supported type without a quantizer here (Q5_K, Q6_K).
        ValueError: ``K`` is not a whole number of blocks, or a value is not finite.
    """
    q = quant_type(t)
    x = np.asarray(values, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % q.block_values:
        raise ValueError(f"rows of {x.shape[-1] if x.ndim else 0} values are not whole {q.name} blocks of "
                         f"{q.block_values}")
    if q.id not in (F32, F16, BF16) and not np.isfinite(x).all():
        raise ValueError(f"{q.name} cannot hold a value that is not finite")
    lead, nb = x.shape[:-1], x.shape[-1] // q.block_values
    blocks = np.ascontiguousarray(x).reshape(-1, q.block_values)
    return _quantize_blocks(blocks, q).reshape(*lead, nb * q.block_bytes)


class QuantizedWeight:
    """A weight matrix kept in a GGUF type: what the kernel tables' ``linear`` and ``embedding``
    take in place of a float32 array where a model is served in its stored types.

    Attributes:
        data: uint8 ``[N, row_bytes(qtype, K)]``, C-contiguous: ``N`` rows of blocks, laid out as
            llama.cpp lays them out (often a view of a memory-mapped GGUF file: nothing is copied);
            held as a read-only view.
        qtype: the GGML type id (``QUANT_TYPES``).
        shape: ``(N, K)``, the matrix's logical shape (``y = x @ W.T`` reads ``K`` values per row).
        activations: how the kernels multiply it: ``"float32"`` activations (the default: the
            products of the dequantized values) or ``"int8"`` (activations quantized per 32 values,
            integer dot products, where the CPU kernels have them: ``--activation-quantization``).
        packed: ``None``, or ``(rows, kernel type id)``: the same rows in the layout a kernel table
            reads them in (the CPU table's ``prepare_weight``: with int8 activations, Q4_K, Q6_K,
            Q8_0, Q4_0 and Q4_1 rows interleaved by 8, ``kernels/cpu/quant_x8.py``); then the kernels read only
            those, and ``data`` stays the GGUF rows (``dequantize``).

    A weight made by ``QuantizedWeight.lazy`` holds no rows until ``data`` is first read, and
    ``release_rows`` drops them again (they are made afresh on the next read): the GGUF loader's q
    and k, whose rows are a copy in another order, so that a kernel table that reads only
    ``packed`` does not hold them twice.
    Raises:
        UnsupportedQuantType: ``qtype`` is not supported.
        ValueError: ``data`` is not C-contiguous uint8 ``[N, row_bytes(qtype, K)]``.
    """

    __slots__ = ("_data", "_make", "qtype", "shape", "activations", "packed")

    def __init__(self, data: np.ndarray, qtype, shape, activations: str = "float32"):
        self._describe(qtype, shape, activations)
        self._data = self._checked(data)

    def _describe(self, qtype, shape, activations):
        q = quant_type(qtype)
        N, K = (int(n) for n in shape)
        if activations not in ("float32", "int8"):
            raise ValueError(f"activations must be float32 or int8, got {activations!r}")
        self.qtype, self.shape, self.activations = q.id, (N, K), activations
        self.packed, self._make, self._data = None, None, None

    @classmethod
    def lazy(cls, make, qtype, shape, activations: str = "float32") -> "QuantizedWeight":
        """A weight whose rows ``make()`` returns (an array as ``data`` takes) when ``data`` is
        first read, and again after ``release_rows``.

        Raises:
            UnsupportedQuantType, ValueError: as the constructor (``make``'s array is checked when
                it is made).
        """
        w = cls.__new__(cls)
        w._describe(qtype, shape, activations)
        w._make = make
        return w

    def _checked(self, data) -> np.ndarray:
        N, K = self.shape
        q = quant_type(self.qtype)
        if not (isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.shape == (N, row_bytes(q, K))
                and data.flags.c_contiguous):
            raise ValueError(f"a {q.name} weight of shape ({N}, {K}) must be C-contiguous uint8 "
                             f"[{N}, {row_bytes(q, K)}], got {getattr(data, 'dtype', type(data))} "
                             f"{getattr(data, 'shape', '')}")
        data = data.view()
        data.flags.writeable = False   # one array type for the kernels (mapped files are read-only)
        return data

    @property
    def data(self) -> np.ndarray:
        """uint8 ``[N, row_bytes(qtype, K)]``: the GGUF rows (see the class's attributes)."""
        data = self._data   # read once: a release_rows on another thread cannot make this None
        if data is None:
            data = self._data = self._checked(self._make())
        return data

    def release_rows(self) -> bool:
        """Drop ``data`` where it can be made again (a ``lazy`` weight): what a kernel table calls
        once it holds its own layout of the rows and no kernel reads these any more (the next read
        of ``data`` makes them afresh). Returns whether they were dropped."""
        if self._make is None:
            return False
        self._data = None
        return True

    ndim = 2

    @property
    def type_name(self) -> str:
        return QUANT_TYPES[self.qtype].name

    @property
    def nbytes(self) -> int:
        """Bytes the kernels read (``packed``'s rows where set); a ``lazy`` weight's rows are not made
        to tell."""
        if self.packed is not None:
            return int(self.packed[0].nbytes)
        return self.shape[0] * row_bytes(quant_type(self.qtype), self.shape[1])

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` values (``dequantize``: bit-exact with gguf-py)."""
        return dequantize(self.data, self.qtype).reshape(self.shape)

    def __repr__(self):
        return f"QuantizedWeight({self.type_name}, shape={self.shape})"
