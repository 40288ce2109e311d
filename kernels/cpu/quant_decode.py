"""One row of GGUF blocks decoded to float32 on the CPU, bit-identical to the NumPy specification.

``decode_row(row, qtype, buf)``: ``buf[:] = dequantize(row, qtype)`` for a row of whole blocks of
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K (``kernels/quant_reference.py`` is
the specification of every type), with the reference's float32 operations in its order (compiled
without fast-math). The products with float32 activations (``quant_linear.py``) and the embedding
lookup decode their weight rows with it; 16 values at a time are explicit LLVM vector code
(``_decode16_*``), as Numba has no vector types.

Sources: llama.cpp ``ggml-quants.c`` ``dequantize_row_*`` (the value of each quant); the GGUF
specification (github.com/ggml-org/ggml/blob/master/docs/gguf.md, tensor data laid out in rows of
blocks).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..quant_reference import BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0
from .quant_int8 import load_f16

__all__ = ["decode_row"]

_F32 = np.float32
_f16 = load_f16   # the binary16 at bytes b[i], b[i + 1] as float32, exactly (vcvtph2ps)


@njit(cache=True, inline="always")
def _i8(v):
    # a uint8 read as int8
    q = np.int32(v)
    return q - ((q >> 7) << 8)


@njit(cache=True, inline="always")
def _u32(b, i):
    return np.uint32(b[i]) | (np.uint32(b[i + 1]) << 8) | (np.uint32(b[i + 2]) << 16) | (np.uint32(b[i + 3]) << 24)


@njit(cache=True, inline="always")
def _k_scale_min(b, o, s):
    # Q4_K / Q5_K: 6-bit scale and min of sub-block s from the 12 bytes at b[o:] (get_scale_min_k4)
    if s < 4:
        return np.int32(b[o + s]) & 63, np.int32(b[o + s + 4]) & 63
    lo = np.int32(b[o + s + 4])
    return (lo & 15) | ((np.int32(b[o + s - 4]) >> 6) << 4), (lo >> 4) | ((np.int32(b[o + s]) >> 6) << 4)


_I8, _I32 = ir.IntType(8), ir.IntType(32)
_LANES = 16


def _splat16(builder, x):
    vt = ir.VectorType(x.type, _LANES)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, _LANES),
                                                                               [0] * _LANES))


def _make_decode16(with_offset: bool):
    # 16 values of a block as explicit vector code: Numba has no vector types and LLVM's loop
    # vectoriser leaves a 16-value loop to its scalar remainder (16 lanes x an unroll of 2-4 do not
    # fit), so the loads, shifts, conversions and products are written as <16 x ...> IR here
    # (LLVM splits them into two 8-lane halves for AVX2). No fast-math flags: d * code (+ m) rounds
    # as the reference's float32 operations do.
    def impl(typingctx, row, qoff, shift, hoff, hshift, hmask, sub, d, m, buf, boff):
        if not (isinstance(row, types.Array) and row.dtype == types.uint8 and isinstance(buf, types.Array)
                and buf.dtype == types.float32):
            return None
        sig = types.void(row, qoff, shift, hoff, hshift, hmask, sub, d, m, buf, boff)

        def codegen(context, builder, sg, args):
            rowv, qoffv, shiftv, hoffv, hshiftv, hmaskv, subv, dv, mv, bufv, boffv = args
            rdata = context.make_array(sg.args[0])(context, builder, rowv).data
            bdata = context.make_array(sg.args[9])(context, builder, bufv).data
            i8v, i32v, f32v = (ir.VectorType(t, _LANES) for t in (_I8, _I32, ir.FloatType()))

            def bytes16(off):
                ptr = builder.bitcast(builder.gep(rdata, [off]), i8v.as_pointer())
                return builder.zext(builder.load(ptr, align=1), i32v)

            def i32(v):
                return builder.trunc(v, _I32) if v.type.width > 32 else builder.zext(v, _I32) \
                    if v.type.width < 32 else v

            q = builder.and_(builder.lshr(bytes16(qoffv), _splat16(builder, i32(shiftv))),
                             ir.Constant(i32v, [15] * _LANES))
            h = builder.and_(builder.lshr(bytes16(hoffv), _splat16(builder, i32(hshiftv))),
                             _splat16(builder, i32(hmaskv)))
            code = builder.sub(builder.or_(q, builder.shl(h, ir.Constant(i32v, [4] * _LANES))),
                               _splat16(builder, i32(subv)))
            val = builder.fmul(_splat16(builder, dv), builder.sitofp(code, f32v))
            if with_offset:
                val = builder.fadd(val, _splat16(builder, mv))
            out = builder.bitcast(builder.gep(bdata, [boffv]), f32v.as_pointer())
            builder.store(val, out, align=4)
            return context.get_dummy_value()

        return sig, codegen
    return intrinsic(impl)


@intrinsic
def _decode16_int8(typingctx, row, qoff, d, buf, boff):
    """``buf[boff + i] = code_i * d`` for i < 16, ``code_i`` the int8 at ``row[qoff + i]`` (Q8_0)."""
    if not (isinstance(row, types.Array) and row.dtype == types.uint8 and isinstance(buf, types.Array)
            and buf.dtype == types.float32):
        return None

    def codegen(context, builder, sg, args):
        rowv, qoffv, dv, bufv, boffv = args
        rdata = context.make_array(sg.args[0])(context, builder, rowv).data
        bdata = context.make_array(sg.args[3])(context, builder, bufv).data
        i8v, i32v, f32v = (ir.VectorType(t, _LANES) for t in (_I8, _I32, ir.FloatType()))
        q = builder.load(builder.bitcast(builder.gep(rdata, [qoffv]), i8v.as_pointer()), align=1)
        val = builder.fmul(builder.sitofp(builder.sext(q, i32v), f32v), _splat16(builder, dv))
        builder.store(val, builder.bitcast(builder.gep(bdata, [boffv]), f32v.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(row, qoff, d, buf, boff), codegen


_decode16_scaled = _make_decode16(False)
_decode16_affine = _make_decode16(True)
_decode16_scaled.__doc__ = """``buf[boff + i] = d * code_i`` for i < 16, ``code_i = ((row[qoff + i] >> shift) & 15 |
((row[hoff + i] >> hshift) & hmask) << 4) - sub`` (uint8 ``row``, float32 ``buf``, int offsets and
fields, float32 ``d``); ``_decode16_affine`` adds float32 ``m`` after the product."""


@njit(cache=True, inline="always")
def _c(v):
    # an integer code as float32, through int32: LLVM then converts 8 or 16 lanes at a time
    # (vcvtdq2ps) instead of 64-bit integers (AVX-512DQ only, or scalar code on AVX2)
    return _F32(np.int32(v))


@njit(cache=True)
def decode_row(row, qtype, buf):
    """``buf[:] = dequantize(row, qtype)`` for one row of GGUF blocks (``row`` uint8 of whole blocks,
    ``buf`` float32 of exactly the row's ``K`` values), with the reference's float32 operations in
    its order (compiled without fast-math: bit-identical).

    How it is vectorised: Q8_0 and the 4-, 5- (Q5_K) and 6-bit types decode 16 values at a time
    in explicit vector code (``_decode16_*``: LLVM's loop vectoriser leaves 16-value loops to their
    scalar remainder, 16 lanes x an unroll of 2-4 not fitting); Q5_0 and Q5_1 loop over a block's
    values to a count derived from the arrays' lengths (``vpb``, the values per block) instead of a
    literal, with which LLVM unrolled the loop fully and then vectorised the loop over *blocks*,
    gathering bytes one by one. Q5_0 and Q5_1 stay scalar: their fifth bits come from a 32-bit
    field, not bytes."""
    nbytes = row.shape[0]
    if qtype == F32:
        bits = buf.view(np.uint32)
        for k in range(nbytes // 4):
            bits[k] = _u32(row, 4 * k)
        return
    if qtype == F16:
        # the float32 bits of each binary16 (sign, exponent rebiased by 127 - 15, significand
        # shifted up; infinities and NaNs keep their payload), subnormals by value (exact)
        bits = buf.view(np.uint32)
        for k in range(nbytes // 2):
            h = np.uint32(row[2 * k]) | (np.uint32(row[2 * k + 1]) << 8)
            e = (h >> 10) & 31
            if e == 0:
                buf[k] = _f16(row, 2 * k)
            else:
                ef = e + np.uint32(112) if e < 31 else np.uint32(255)
                bits[k] = ((h & 0x8000) << 16) | (ef << 23) | ((h & 1023) << 13)
        return
    if qtype == BF16:
        bits = buf.view(np.uint32)
        for k in range(nbytes // 2):
            bits[k] = (np.uint32(row[2 * k]) | (np.uint32(row[2 * k + 1]) << 8)) << 16
        return
    bb = 34 if qtype == Q8_0 else 18 if qtype == Q4_0 else 20 if qtype == Q4_1 else 22 if qtype == Q5_0 else \
        24 if qtype == Q5_1 else 144 if qtype == Q4_K else 176 if qtype == Q5_K else 210
    nb = nbytes // bb
    if nb == 0:
        return
    vpb = buf.shape[0] // nb      # 32 or 256, unknown to the compiler (see above)
    half = vpb >> 1
    if qtype == Q8_0:
        for b in range(nb):
            o, k0 = 34 * b, vpb * b
            d = _f16(row, o)
            _decode16_int8(row, o + 2, d, buf, k0)
            _decode16_int8(row, o + 18, d, buf, k0 + 16)
    elif qtype == Q4_0:
        for b in range(nb):
            o, k0 = 18 * b, vpb * b
            d = _f16(row, o)
            _decode16_scaled(row, o + 2, 0, o + 2, 0, 0, 8, d, d, buf, k0)
            _decode16_scaled(row, o + 2, 4, o + 2, 0, 0, 8, d, d, buf, k0 + 16)
    elif qtype == Q4_1:
        for b in range(nb):
            o, k0 = 20 * b, vpb * b
            d, m = _f16(row, o), _f16(row, o + 2)
            _decode16_affine(row, o + 4, 0, o + 4, 0, 0, 0, d, m, buf, k0)
            _decode16_affine(row, o + 4, 4, o + 4, 0, 0, 0, d, m, buf, k0 + 16)
    elif qtype == Q5_0:
        for b in range(nb):
            o, k0 = 22 * b, vpb * b
            d = _f16(row, o)
            qh = _u32(row, o + 2)
            for j in range(half):
                buf[k0 + j] = d * _c(((row[o + 6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16)
            for j in range(half):
                buf[k0 + half + j] = d * _c(((row[o + 6 + j] >> 4) | (((qh >> (j + half)) & 1) << 4)) - 16)
    elif qtype == Q5_1:
        for b in range(nb):
            o, k0 = 24 * b, vpb * b
            d, m = _f16(row, o), _f16(row, o + 2)
            qh = _u32(row, o + 4)
            for j in range(half):
                buf[k0 + j] = d * _c((row[o + 8 + j] & 15) | (((qh >> j) & 1) << 4)) + m
            for j in range(half):
                buf[k0 + half + j] = d * _c((row[o + 8 + j] >> 4) | (((qh >> (j + half)) & 1) << 4)) + m
    elif qtype == Q4_K or qtype == Q5_K:
        qs0 = 16 if qtype == Q4_K else 48
        sub = vpb >> 3             # 32 values per sub-block
        for b in range(nb):
            o, k0 = bb * b, vpb * b
            d, dmin = _f16(row, o), _f16(row, o + 2)
            for c in range(4):
                q = o + qs0 + sub * c
                for nib in range(2):
                    s = 2 * c + nib
                    sc, mn = _k_scale_min(row, o + 4, s)
                    d1 = d * _c(sc)
                    m1 = dmin * _c(mn)
                    base = k0 + sub * s
                    # d1 * q - m1 is d1 * q + (-m1), bit for bit (IEEE subtraction)
                    hm = 0 if qtype == Q4_K else 1
                    for half16 in range(2):
                        _decode16_affine(row, q + 16 * half16, 4 * nib, o + 16 + 16 * half16, s, hm, 0, d1, -m1,
                                         buf, base + 16 * half16)
    else:  # Q6_K
        sub = vpb >> 4             # 16 values per sub-block
        for b in range(nb):
            o, k0 = 210 * b, vpb * b
            d = _f16(row, o + 208)
            for h in range(2):
                ql, qh = o + 64 * h, o + 128 + 32 * h
                for g in range(4):
                    src = ql + 32 * (g & 1)
                    shift = 4 * (g >> 1)
                    for part in range(2):
                        s = 8 * h + 2 * g + part
                        ds = d * _c(_i8(row[o + 192 + s]))
                        base = k0 + sub * s
                        l0 = 16 * part
                        _decode16_scaled(row, src + l0, shift, qh + l0, 2 * g, 3, 32, ds, ds, buf, base)
