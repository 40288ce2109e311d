"""Decode-and-dot in one pass for one token: the float32-activation path's single-sequence decode products.

``quant_linear``'s float32-activation path decodes weight rows into a scratch buffer and then takes
dot products from it (``_rows``); for the decode step of one sequence the products are a small share
and the store and reload of every decoded value, and a second loop, are not. Here each 32 weights of
a row are decoded in registers (the codes unpacked as ``quant_int8`` does, converted to float32 and
scaled with the reference's float32 operations, so every weight value is bit-identical to
``dequantize``'s) and multiplied-added straight into 32 float32 lanes per token (4 vectors of 8 on
AVX2, 2 of 16 on AVX-512, as LLVM splits them); an intrinsic of ``nt`` = 1 token alternates blocks
between two sets of accumulators, one of ``nt`` = ``_NT`` tokens keeps one set per token. The sums
are float32 dot products of ``K`` terms with the exactly dequantized weights in another order than
``_rows``': within the same bound (``gamma(K) sum |x_k w_k|``).

Q4_K, Q5_K and Q6_K (``_make_fdot_superblock``) take one 256-value superblock per loop trip, every byte
offset in it a constant and the block's scales decoded as vectors in registers (a per-block form
spends most of its instructions on index arithmetic).
Where the reference's weight is ``a * q + b`` with ``a * q`` exact (Q4_1: an 11-bit ``d`` times a
4-bit code; Q4_K / Q5_K: ``d * sc``, 17 bits, times a 4- or 5-bit code; all under float32's 24), it is computed
as one fused multiply-add: its one rounding is the reference's addition, so the value is the same.

Types: ``FUSED_TYPES`` (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K). Needs AVX2 (``quant_int8.ISA`` not
``None``: the 16-bit shifts and F16C conversions); elsewhere ``_rows`` serves.

Sources: llama.cpp ``ggml-quants.c`` ``dequantize_row_*`` (each value's float operations).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant_reference import Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0
from .quant_int8 import _NT, _RES, _c64, _call, _k_codes, _k_scales_v8, _lane_splat, _load, _q6k_codes, _splat

__all__ = ["FUSED_TYPES", "FUSED_MAX_TOKENS", "fused_rows"]

FUSED_TYPES = (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)
FUSED_MAX_TOKENS = 8
"""Products of at most this many tokens take ``fused_rows``; more, ``quant_linear``'s decoded rows
and dot products (``_rows``)."""

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_FL, _HALF = ir.FloatType(), ir.HalfType()
_V32I8, _V16I16, _V32I32, _V32F = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 32),
                                   ir.VectorType(_FL, 32))


def _store_sums(builder, sf, accs, vt):
    """Each token's accumulators (``accs[i]``: one or more ``vt`` float vectors) summed into one
    float32, into ``sf[_RES + i]`` (float32*)."""
    reduce = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FL, [_FL, vt]),
                                            f"llvm.vector.reduce.fadd.v{vt.count}f32")
    for i, sets in enumerate(accs):
        acc = builder.load(sets[0])
        for a in sets[1:]:
            acc = builder.fadd(acc, builder.load(a))
        total = builder.call(reduce, [ir.Constant(_FL, 0.0), acc], fastmath=("reassoc",))
        builder.store(total, builder.gep(sf, [_c64(_RES + i)]))


def _fdot_signature(w, x, s):
    # the fused intrinsics' (w, woff, x, t0, s): uint8 weights, float32 x [T, K], a float32 scratch row
    if not (isinstance(w, types.Array) and w.dtype == types.uint8 and isinstance(x, types.Array)
            and x.dtype == types.float32 and x.ndim == 2 and isinstance(s, types.Array)
            and s.dtype == types.float32):
        return None
    return types.void(w, types.int64, x, types.int64, s)


def _fdot_args(context, builder, sg, args):
    # (weights' i8*, woff, x's array struct, t0, the scratch's float*) of a fused intrinsic's call
    wv, woffv, xv, t0v, sv = args
    return (context.make_array(sg.args[0])(context, builder, wv).data, woffv,
            context.make_array(sg.args[2])(context, builder, xv), t0v,
            context.make_array(sg.args[4])(context, builder, sv).data)


def _make_fdot(kind: str, nt: int):
    """An intrinsic: ``(w, woff, x, t0, s)``: the float32 dot products of the weight row at byte
    ``woff`` of uint8 ``w`` with rows ``t0 .. t0 + nt - 1`` of float32 ``x [T, K]`` (rows of contiguous values),
    into ``s[_RES + i]`` (float32 scratch). Types with 32-value blocks (Q8_0, Q4_0, Q4_1)."""

    def impl(typingctx, w, woff, x, t0, s):
        sig = _fdot_signature(w, x, s)
        if sig is None:
            return None

        def codegen(context, builder, sg, args):
            wp, woffv, xarr, t0v, sf = _fdot_args(context, builder, sg, args)
            xp = xarr.data
            K = builder.extract_value(xarr.shape, 1)
            xstride = builder.udiv(builder.extract_value(xarr.strides, 0), _c64(4))   # elements per token row
            n32 = builder.udiv(K, _c64(32))
            sets = 2 if nt == 1 else 1
            acc_sets = [[cgutils.alloca_once_value(builder, ir.Constant(_V32F, [0.0] * 32)) for _ in range(nt)]
                        for _ in range(sets)]

            def load(ptr, off, ty):
                return _load(builder, ptr, off, ty)

            def half(off):
                return builder.fpext(load(wp, off, _HALF), _FL)

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
                    else:
                        # d * q + m as one fused multiply-add: d * q is exact (11-bit d x 4-bit q),
                        # so its one rounding is the reference's addition
                        wvals = _call(builder, "llvm.fma.v32f32", _V32F, [
                            fsplat(half(base)), builder.sitofp(codes, _V32F), fsplat(half(builder.add(base, _c64(2))))])
                for i in range(nt):
                    row = builder.mul(builder.add(t0v, _c64(i)), xstride)
                    xv = load(xp, builder.add(row, builder.mul(j, _c64(32))), _V32F)
                    builder.store(_call(builder, "llvm.fma.v32f32", _V32F, [wvals, xv, builder.load(accs[i])]),
                                  accs[i])

            # 8 blocks per loop trip (their offsets constants from the group's), then the rest
            n8 = builder.udiv(n32, _c64(8))
            with cgutils.for_range(builder, n8) as loop:
                g0 = builder.mul(loop.index, _c64(8))
                for k in range(8):
                    block(builder.add(g0, _c64(k)), acc_sets[k % sets])
            with cgutils.for_range(builder, builder.sub(n32, builder.mul(n8, _c64(8)))) as loop:
                block(builder.add(builder.mul(n8, _c64(8)), loop.index), acc_sets[0])
            _store_sums(builder, sf, [[acc_sets[k][i] for k in range(sets)] for i in range(nt)], _V32F)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_fdot_{kind}_{nt}"
    return intrinsic(impl)


def _make_fdot_superblock(kind: str, nt: int):
    """An intrinsic ``(w, woff, x, t0, s)`` as ``_make_fdot``'s, for Q4_K, Q5_K or Q6_K one 256-value
    superblock per loop trip: every byte offset inside the block a constant, the block's scales
    decoded as vectors in registers (no scratch), the 8 (Q4_K, Q5_K) or 16 (Q6_K) sub-blocks unrolled.
    Each weight value is the reference's: Q4_K / Q5_K ``(d * sc) * q + (-(dmin * m))``, Q6_K ``(d * sc) * q``
    (float32 operations in that order, no contraction)."""

    def impl(typingctx, w, woff, x, t0, s):
        sig = _fdot_signature(w, x, s)
        if sig is None:
            return None

        def codegen(context, builder, sg, args):
            wp, woffv, xarr, t0v, sf = _fdot_args(context, builder, sg, args)
            K = builder.extract_value(xarr.shape, 1)
            xstride = builder.udiv(builder.extract_value(xarr.strides, 0), _c64(4))
            xrows = [builder.gep(xarr.data, [builder.mul(builder.add(t0v, _c64(i)), xstride)]) for i in range(nt)]
            nb = builder.udiv(K, _c64(256))
            bb = {"q4_k": 144, "q5_k": 176, "q6_k": 210}[kind]
            # one token: two sets of accumulators, sub-blocks alternating between them (the chains
            # of fused multiply-adds); more tokens: one per token
            sets = 2 if nt == 1 else 1
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V32F, [0.0] * 32)) for _ in range(sets)]
                    for _ in range(nt)]
            v32i8 = _V32I8

            def load(ptr, off, ty):
                return _load(builder, ptr, off, ty)

            def fma_into(sb, wvals, xbs, k):
                # the decoded values of sub-block sb (at value k of the superblock) into every token
                for i in range(nt):
                    acc = accs[i][sb % sets]
                    xv = load(xbs[i], _c64(k), _V32F)
                    builder.store(_call(builder, "llvm.fma.v32f32", _V32F, [wvals, xv, builder.load(acc)]), acc)

            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                ob = builder.gep(wp, [builder.add(woffv, builder.mul(b, _c64(bb)))])
                xb = [builder.gep(xrows[i], [builder.mul(b, _c64(256))]) for i in range(nt)]
                if kind in ("q4_k", "q5_k"):
                    d = builder.fpext(load(ob, _c64(0), _HALF), _FL)
                    dmin = builder.fpext(load(ob, _c64(2), _HALF), _FL)
                    sc, mn = _k_scales_v8(builder, load(ob, _c64(4), ir.VectorType(_I8, 16)))
                    v8f = ir.VectorType(_FL, 8)
                    d1 = builder.fmul(_splat(builder, d, v8f), builder.sitofp(sc, v8f))
                    negm = builder.fneg(builder.fmul(_splat(builder, dmin, v8f), builder.sitofp(mn, v8f)))
                    for sb, codes in enumerate(_k_codes(builder, ob, kind)):
                        f = builder.sitofp(builder.zext(codes, _V32I32), _V32F)
                        # d1 * q is exact (11-bit d x 6-bit sc x 4- or 5-bit q < 24 bits), so the
                        # one rounding of the fused multiply-add is the reference's subtraction
                        wvals = _call(builder, "llvm.fma.v32f32", _V32F, [
                            _lane_splat(builder, d1, sb, 32), f, _lane_splat(builder, negm, sb, 32)])
                        fma_into(sb, wvals, xb, 32 * sb)
                else:  # q6_k
                    d = builder.fpext(load(ob, _c64(208), _HALF), _FL)
                    v16f = ir.VectorType(_FL, 16)
                    scv = builder.sitofp(builder.sext(load(ob, _c64(192), ir.VectorType(_I8, 16)),
                                                      ir.VectorType(_I32, 16)), v16f)
                    ds = builder.fmul(_splat(builder, d, v16f), scv)
                    q6 = _q6k_codes(builder, ob)
                    for h in range(2):
                        for g in range(4):
                            codes = q6[4 * h + g]
                            # q - 32 in bytes (-32..31), then widened with its sign
                            codes = builder.sext(builder.sub(codes, ir.Constant(v32i8, [32] * 32)), _V32I32)
                            s0 = 8 * h + 2 * g
                            scale = builder.shuffle_vector(ds, ds, ir.Constant(ir.VectorType(_I32, 32),
                                                                               [s0] * 16 + [s0 + 1] * 16))
                            wvals = builder.fmul(scale, builder.sitofp(codes, _V32F))
                            fma_into(g, wvals, xb, 128 * h + 32 * g)
            _store_sums(builder, sf, accs, _V32F)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_fdot_sb_{kind}_{nt}"
    return intrinsic(impl)


_fdot_q8_0, _fdot_q4_0, _fdot_q4_1 = _make_fdot("q8_0", 1), _make_fdot("q4_0", 1), _make_fdot("q4_1", 1)
_fdot_q4_k, _fdot_q6_k = _make_fdot_superblock("q4_k", 1), _make_fdot_superblock("q6_k", 1)
_fdot_q5_k, _fdot_q5_k_4 = _make_fdot_superblock("q5_k", 1), _make_fdot_superblock("q5_k", _NT)
_fdot_q8_0_4, _fdot_q4_0_4, _fdot_q4_1_4 = (_make_fdot("q8_0", _NT), _make_fdot("q4_0", _NT),
                                            _make_fdot("q4_1", _NT))
_fdot_q4_k_4, _fdot_q6_k_4 = _make_fdot_superblock("q4_k", _NT), _make_fdot_superblock("q6_k", _NT)


@njit(cache=True)
def fused_rows(x, w, qtype, out, col0, s, r0, r1):
    """``out[t, col0 + r] = x[t] @ dequantize(w[r])`` for ``r0 <= r < r1`` and every token ``t`` of
    float32 ``x [T, K]`` (``T <= FUSED_MAX_TOKENS``): each row's blocks decoded in registers once
    per pass of up to ``_NT`` tokens (the row's bytes in L1 for the next pass), ``qtype`` one of
    ``FUSED_TYPES``, ``s`` a task's scratch row (``quant_scratch``; the results pass through it)."""
    T = x.shape[0]
    rb = w.shape[1]
    for r in range(r0, r1):
        woff = r * rb
        t = 0
        while T - t >= _NT:
            if qtype == Q8_0:
                _fdot_q8_0_4(w, woff, x, t, s)
            elif qtype == Q4_0:
                _fdot_q4_0_4(w, woff, x, t, s)
            elif qtype == Q4_1:
                _fdot_q4_1_4(w, woff, x, t, s)
            elif qtype == Q4_K:
                _fdot_q4_k_4(w, woff, x, t, s)
            elif qtype == Q5_K:
                _fdot_q5_k_4(w, woff, x, t, s)
            else:
                _fdot_q6_k_4(w, woff, x, t, s)
            for i in range(_NT):
                out[t + i, col0 + r] = s[_RES + i]
            t += _NT
        while t < T:
            if qtype == Q8_0:
                _fdot_q8_0(w, woff, x, t, s)
            elif qtype == Q4_0:
                _fdot_q4_0(w, woff, x, t, s)
            elif qtype == Q4_1:
                _fdot_q4_1(w, woff, x, t, s)
            elif qtype == Q4_K:
                _fdot_q4_k(w, woff, x, t, s)
            elif qtype == Q5_K:
                _fdot_q5_k(w, woff, x, t, s)
            else:
                _fdot_q6_k(w, woff, x, t, s)
            out[t, col0 + r] = s[_RES]
            t += 1
