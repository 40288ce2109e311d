"""Decode-and-dot in one pass for one token: the float32-activation path's single-sequence decode products.

``quant_linear``'s float32-activation path decodes weight rows into a scratch buffer and then takes
dot products from it (``_rows``); for the decode step of one sequence the products are a small share
and the store and reload of every decoded value, and a second loop, are not. Here each 32 weights of
a row are decoded in registers (the codes unpacked as ``quant_int8`` does, converted to float32 and
scaled with the reference's float32 operations, so every weight value is bit-identical to
``dequantize``'s) and multiplied-added straight into 32 float32 lanes per token (4 vectors of 8 on
AVX2, 2 of 16 on AVX-512, as LLVM splits them), alternating blocks between two sets of accumulators
(the intrinsics take ``nt`` tokens; one is what measured faster). The sums are float32 dot products
of ``K`` terms with the exactly dequantized weights in another order than ``_rows``': within the
same bound (``gamma(K) sum |x_k w_k|``).

Types: ``FUSED_TYPES`` (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K). Needs AVX2 (``quant_int8.ISA`` not
``None``: the 16-bit shifts and F16C conversions); elsewhere ``_rows`` serves.

Sources: llama.cpp ``ggml-quants.c`` ``dequantize_row_*`` (each value's float operations).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant_reference import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0
from .quant_int8 import _RES, _WS, _c64, _call, _q4k_scales, _splat

__all__ = ["FUSED_TYPES", "FUSED_MAX_TOKENS", "fused_rows"]

FUSED_TYPES = (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)
FUSED_MAX_TOKENS = 1
"""Products of at most this many tokens take ``fused_rows`` (measured: at 2 tokens the decode-once,
dot-twice ``_rows`` is as fast, 0.9-1.2x either way)."""

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_FL, _HALF = ir.FloatType(), ir.HalfType()
_V32I8, _V16I16, _V32I32, _V32F = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 32),
                                   ir.VectorType(_FL, 32))


def _make_fdot(kind: str, nt: int):
    """An intrinsic: ``(w, woff, x, t0, s)``: the float32 dot products of the weight row at byte
    ``woff`` of uint8 ``w`` with rows ``t0 .. t0 + nt - 1`` of float32 ``x [T, K]`` (rows of contiguous values),
    into ``s[_RES + i]`` (float32 scratch; Q4_K's per-block scales at ``_WS``, ``_q4k_scales``)."""

    def impl(typingctx, w, woff, x, t0, s):
        if not (isinstance(w, types.Array) and w.dtype == types.uint8 and isinstance(x, types.Array)
                and x.dtype == types.float32 and x.ndim == 2 and isinstance(s, types.Array)
                and s.dtype == types.float32):
            return None
        sig = types.void(w, types.int64, x, types.int64, s)

        def codegen(context, builder, sg, args):
            wv, woffv, xv_, t0v, sv = args
            wp = context.make_array(sg.args[0])(context, builder, wv).data
            xarr = context.make_array(sg.args[2])(context, builder, xv_)
            xp = xarr.data
            K = builder.extract_value(xarr.shape, 1)
            xstride = builder.udiv(builder.extract_value(xarr.strides, 0), _c64(4))   # elements per token row
            sf = context.make_array(sg.args[4])(context, builder, sv).data
            n32 = builder.udiv(K, _c64(32))
            sets = 2 if nt == 1 else 1
            acc_sets = [[cgutils.alloca_once_value(builder, ir.Constant(_V32F, [0.0] * 32)) for _ in range(nt)]
                        for _ in range(sets)]

            def load(ptr, off, ty):
                return builder.load(builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer()), align=1)

            def half(off):
                return builder.fpext(load(wp, off, _HALF), _FL)

            def nibbles(off, shift):
                v = builder.lshr(load(wp, off, _V16I16), _splat(builder, builder.trunc(shift, _I16), _V16I16))
                return builder.and_(builder.bitcast(v, _V32I8), ir.Constant(_V32I8, [15] * 32))

            def fsplat(v):
                return _splat(builder, v, _V32F)

            def block(j, accs):
                # the 32 weights of block j as float32, each with the reference's operations
                if kind == "q8_0":
                    base = builder.add(woffv, builder.mul(j, _c64(34)))
                    c = builder.sitofp(builder.sext(load(wp, builder.add(base, _c64(2)), _V32I8), _V32I32), _V32F)
                    wvals = builder.fmul(fsplat(half(base)), c)
                elif kind in ("q4_0", "q4_1"):
                    bb, qo = (18, 2) if kind == "q4_0" else (20, 4)
                    base = builder.add(woffv, builder.mul(j, _c64(bb)))
                    b16 = load(wp, builder.add(base, _c64(qo)), ir.VectorType(_I8, 16))
                    lo = builder.and_(b16, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
                    hi = builder.lshr(b16, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
                    codes = builder.zext(builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32),
                                                                                     list(range(32)))), _V32I32)
                    if kind == "q4_0":
                        codes = builder.sub(codes, ir.Constant(_V32I32, [8] * 32))
                    wvals = builder.fmul(fsplat(half(base)), builder.sitofp(codes, _V32F))
                    if kind == "q4_1":
                        wvals = builder.fadd(wvals, fsplat(half(builder.add(base, _c64(2)))))
                elif kind == "q4_k":
                    sb, sub = builder.udiv(j, _c64(8)), builder.urem(j, _c64(8))
                    base = builder.add(builder.add(woffv, builder.mul(sb, _c64(144))),
                                       builder.add(_c64(16), builder.mul(builder.udiv(sub, _c64(2)), _c64(32))))
                    codes = builder.zext(nibbles(base, builder.mul(builder.urem(sub, _c64(2)), _c64(4))), _V32I32)
                    d1 = builder.load(builder.gep(sf, [builder.add(_c64(_WS), j)]))
                    m1 = builder.load(builder.gep(sf, [builder.add(builder.add(_c64(_WS), n32), j)]))
                    wvals = builder.fadd(builder.fmul(fsplat(d1), builder.sitofp(codes, _V32F)), fsplat(m1))
                else:  # q6_k
                    sb, sub = builder.udiv(j, _c64(8)), builder.urem(j, _c64(8))
                    h, g = builder.udiv(sub, _c64(4)), builder.urem(sub, _c64(4))
                    o = builder.add(woffv, builder.mul(sb, _c64(210)))
                    ql = builder.add(builder.add(o, builder.mul(h, _c64(64))),
                                     builder.mul(builder.urem(g, _c64(2)), _c64(32)))
                    lo = nibbles(ql, builder.mul(builder.udiv(g, _c64(2)), _c64(4)))
                    qh = load(wp, builder.add(builder.add(o, _c64(128)), builder.mul(h, _c64(32))), _V16I16)
                    qh = builder.lshr(qh, _splat(builder, builder.trunc(builder.mul(g, _c64(2)), _I16), _V16I16))
                    qh = builder.and_(builder.bitcast(qh, _V32I8), ir.Constant(_V32I8, [3] * 32))
                    codes = builder.zext(builder.or_(lo, builder.shl(qh, ir.Constant(_V32I8, [4] * 32))), _V32I32)
                    codes = builder.sub(codes, ir.Constant(_V32I32, [32] * 32))
                    sc_off = builder.add(builder.add(o, _c64(192)),
                                         builder.add(builder.mul(h, _c64(8)), builder.mul(g, _c64(2))))
                    d = half(builder.add(o, _c64(208)))
                    ds0 = builder.fmul(d, builder.sitofp(load(wp, sc_off, _I8), _FL))
                    ds1 = builder.fmul(d, builder.sitofp(load(wp, builder.add(sc_off, _c64(1)), _I8), _FL))
                    half_t = ir.VectorType(_FL, 16)
                    scv = builder.shuffle_vector(_splat(builder, ds0, half_t), _splat(builder, ds1, half_t),
                                                 ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
                    wvals = builder.fmul(scv, builder.sitofp(codes, _V32F))
                for i in range(nt):
                    row = builder.mul(builder.add(t0v, _c64(i)), xstride)
                    xv = load(xp, builder.add(row, builder.mul(j, _c64(32))), _V32F)
                    builder.store(_call(builder, "llvm.fma.v32f32", _V32F, [wvals, xv, builder.load(accs[i])]),
                                  accs[i])

            with cgutils.for_range(builder, builder.udiv(n32, _c64(sets))) as loop:
                for k in range(sets):
                    block(builder.add(builder.mul(loop.index, _c64(sets)), _c64(k)), acc_sets[k])
            if sets == 2:
                with builder.if_then(builder.icmp_unsigned("!=", builder.urem(n32, _c64(2)), _c64(0))):
                    block(builder.sub(n32, _c64(1)), acc_sets[0])
            for i in range(nt):
                acc = builder.load(acc_sets[0][i])
                for k in range(1, sets):
                    acc = builder.fadd(acc, builder.load(acc_sets[k][i]))
                total = builder.call(cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_FL, [_FL, _V32F]), "llvm.vector.reduce.fadd.v32f32"),
                    [ir.Constant(_FL, 0.0), acc], fastmath=("reassoc",))
                builder.store(total, builder.gep(sf, [_c64(_RES + i)]))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_fdot_{kind}_{nt}"
    return intrinsic(impl)


_fdot_q8_0, _fdot_q4_0, _fdot_q4_1 = _make_fdot("q8_0", 1), _make_fdot("q4_0", 1), _make_fdot("q4_1", 1)
_fdot_q4_k, _fdot_q6_k = _make_fdot("q4_k", 1), _make_fdot("q6_k", 1)


@njit(cache=True)
def fused_rows(x, w, qtype, out, col0, s, r0, r1):
    """``out[0, col0 + r] = x[0] @ dequantize(w[r])`` for ``r0 <= r < r1``: one token (``x [1, K]``
    float32), ``qtype`` one of ``FUSED_TYPES``, ``s`` a task's scratch row (``quant_scratch``: Q4_K's
    per-block scales and the result)."""
    K = x.shape[1]
    n32 = K // 32
    rb = w.shape[1]
    for r in range(r0, r1):
        woff = r * rb
        if qtype == Q8_0:
            _fdot_q8_0(w, woff, x, 0, s)
        elif qtype == Q4_0:
            _fdot_q4_0(w, woff, x, 0, s)
        elif qtype == Q4_1:
            _fdot_q4_1(w, woff, x, 0, s)
        elif qtype == Q4_K:
            _q4k_scales(w[r], n32, s)
            _fdot_q4_k(w, woff, x, 0, s)
        else:
            _fdot_q6_k(w, woff, x, 0, s)
        out[0, col0 + r] = s[_RES]
