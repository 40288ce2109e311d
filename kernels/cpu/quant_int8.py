"""Integer dot products of GGUF-quantized weight rows with activations quantized to 8 bits, on the CPU.

The second way ``quant_linear`` computes (``kernels/cpu/quant_linear.py`` chooses, and says when),
as llama.cpp's ``ggml_vec_dot_q4_0_q8_0`` / ``q4_1_q8_1`` / ``q8_0_q8_0`` / ``q4_K_q8_K`` /
``q6_K_q8_K``:

* **Activations** (``quantize_activations``): each token's row of ``K`` float32 values in blocks
  of 32, as ``Q8_0`` / ``Q8_1`` (``quantize_row_q8_1_ref``): ``d = max|x| / 127``, codes ``q =
  rint(x / d)`` (via ``x * (1 / d)``) in ``[-127, 127]``, and per block ``d``, ``d * sum(q)`` (the
  sum the weights' offsets and mins multiply) and the int16 sums of each half's codes (Q6_K's
  ``-32``). One block size for every weight type: the K-types' sub-blocks are 32 values (Q4_K) or
  two halves of 32 (Q6_K), so a 32-value activation block meets one weight scale (or two, Q6_K,
  applied in the integer sums), finer than llama.cpp's 256-value ``Q8_K`` (smaller rounding error).
* **Types of 32-value blocks** (Q8_0, Q4_0, Q4_1; ``_make_idot``), per block: one 256-bit integer
  dot product of the weight codes (unsigned bytes) with the activation codes (signed bytes):
  ``vpdpbusd`` (AVX512-VNNI, 4 products into each of 8 int32 lanes) where Numba compiles for it,
  else ``vpmaddubsw`` + ``vpmaddwd`` (AVX2: pairs into int16, then pairs into int32; no
  saturation: ``2 * 128 * 127 < 2^15``), converted to float32 and multiplied-added into 8 float32
  lanes per token with ``d_w * d_x``; the offset (``Q4_0``'s ``-8 d``, ``Q4_1``'s ``m``) as
  ``offset * (d_x sum q)``, one scalar per block. ``Q8_0``'s signed codes: ``|w|`` and ``x`` with
  ``w``'s sign (``vpsignb``), as llama.cpp's ``mul_sum_i8_pairs``.
* **K-quants** (Q4_K, Q5_K, Q6_K; ``_make_idot_superblock``), one 256-value superblock per loop trip,
  every byte offset in it a constant: the 8 or 16 scales (and Q4_K's mins) decoded as vectors,
  then per token the 8 blocks' integer dot products (Q4_K, Q5_K: ``vpdpbusd``, Q5_K's fifth bits
  or-ed into the codes; Q6_K: codes 0..63 by
  ``vpmaddubsw``, then ``vpmaddwd`` with the two 16-value sub-blocks' scales, as llama.cpp's AVX2
  ``q6_K_q8_K``) summed across their lanes together (``_hsum8``: a ``vphaddd`` tree), Q6_K's ``-32
  sc sum x`` from the activations' half sums (one ``vpmaddwd`` with the 16 scales, as llama.cpp's
  ``bsums``), one conversion and one ``<8 x float>`` multiply-add with ``d_w sc * d_x`` per
  superblock; Q4_K's and Q5_K's mins as one ``<8 x float>`` multiply-add of ``dmin m`` with ``d_x sum q``.
* Up to 4 tokens per pass over a row (``_idot_<type>_<n>``: the codes unpacked once, 4 float
  accumulators), the row's bytes in L1 for the next 4.

The vector code is LLVM IR written here (Numba has no vector types; as ``decode_row``'s
``_decode16_*`` and ``simd.py``), 256 bits wide on AVX2 and AVX-512 alike (Zen 4 runs 512-bit
integer products as two 256-bit halves; one block is 32 bytes).

Types: ``INT8_TYPES`` (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: the Q4_K_M, Q5_K_M, Q6_K, Q8_0 and
default-model files).
``ISA``: ``"avx512vnni"``, ``"avx2"``, or ``None`` where Numba compiles for neither (the caller
then keeps float32 activations).

Sources: llama.cpp ``ggml/src/ggml-cpu/arch/x86/quants.c`` (``mul_sum_us8_pairs_float``,
``mul_sum_i8_pairs_float``, ``ggml_vec_dot_q6_K_q8_K``), ``ggml-quants.c``
(``quantize_row_q8_1_ref``); Intel's intrinsics guide (``vpdpbusd``, ``vpmaddubsw``,
``vpmaddwd``, ``vpsignb``); LLVM's X86 intrinsics (``llvm.x86.avx512.vpdpbusd.256``,
``llvm.x86.avx2.pmadd.ub.sw``, ``llvm.x86.avx2.pmadd.wd``, ``llvm.x86.avx2.psign.b``).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant_reference import Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0

__all__ = ["ISA", "INT8_TYPES", "INT8_BLOCK", "quantize_activations", "int8_rows", "int8_scratch_size", "load_f16"]

INT8_TYPES = (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)
INT8_BLOCK = 32
_F32 = np.float32
_NT = 4   # tokens per pass over a row


def _isa() -> str | None:
    # the instruction set Numba's JIT compiles for (NUMBA_CPU_FEATURES, else the host's: the list
    # Numba keys its cache on, as simd.compiles_avx512)
    from numba.core import codegen, config
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    on = {}
    for f in features.split(","):
        f = f.strip()
        if f[:1] in ("+", "-"):   # not `in "+-"`: the empty string (an empty feature list) is in every string
            on[f[1:]] = f[0] == "+"
    if on.get("avx512vnni") and on.get("avx512vl"):
        return "avx512vnni"
    if on.get("avx2"):
        return "avx2"
    return None


ISA = _isa()
"""``"avx512vnni"`` (``vpdpbusd``), ``"avx2"`` (``vpmaddubsw`` + ``vpmaddwd``) or ``None`` (no
integer path): the level Numba compiles the integer dot products for."""

# per-task scratch layout (float32 slots): a key, then the results of one pass, then the K-types'
# per-block scales, then the quantized activations
_KEY = 0           # int64 slots 0..3 (float32 slots 0..7): x's address, w's address, T, K
_RES = 8           # _NT results of one pass
_XD = 16           # the activations' block scales, then their block sums, then their codes


@njit(cache=True)
def int8_scratch_size(T, K):
    """float32 slots of the integer path's part of a task's scratch for ``T`` tokens of ``K`` values:
    the key, ``_NT`` results, ``T K / 32`` activation scales and sums, ``T K`` bytes of codes,
    ``T K / 16`` int16 sums of 16 codes."""
    n32 = -(-K // INT8_BLOCK)
    return _XD + 3 * T * n32 + (T * n32 * INT8_BLOCK) // 4 + 16


@njit(cache=True, inline="always")
def _offsets(T, K):
    n32 = K // INT8_BLOCK
    xd = _XD
    xs = xd + T * n32
    xq = xs + T * n32           # float32 slot where the codes start (bytes: 4 xq)
    xb = xq + (T * K) // 4      # float32 slot where the int16 sums of 16 codes start (Q6_K's offsets)
    return n32, xd, xs, xq, xb


@njit(cache=True, fastmath=True, inline="always")
def _amax32(x, t, k0):
    m = _F32(0.0)
    for i in range(INT8_BLOCK):
        m = max(m, abs(x[t, k0 + i]))
    return m


@njit(cache=True)
def quantize_activations(x, s):
    """Quantize float32 ``x [T, K]`` (``K`` a multiple of 32) into the scratch row ``s`` (float32, at
    least ``int8_scratch_size(T, K)``): per token and block of 32, ``d = max|x| / 127``, codes
    ``rint(x * (1 / d))`` (0 where ``d == 0``; ``rint(x / d)`` where ``1 / d`` overflows), ``d``, ``d * sum(codes)`` and the sums of the codes
    of each half (int16, ``|sum| <= 16 * 127``). A block holding a NaN gets the scale NaN (its
    codes 0 where NaN), so every product with that token is NaN, as with float32 activations."""
    T, K = x.shape
    n32, xd, xs, xq, xb = _offsets(T, K)
    codes = s[xq:xq + (T * K) // 4].view(np.int8)
    halves = s[xb:xb + T * n32].view(np.int16)
    for t in range(T):
        for j in range(n32):
            k0 = INT8_BLOCK * j
            d = _amax32(x, t, k0) / _F32(127.0)
            inv = _F32(1.0) / d if d != 0 else _F32(0.0)
            # below ~2.9e-39 (|x| < ~3.7e-37) 1 / d overflows: then x / d, which cannot
            by_d = inv == np.inf
            acc = 0
            nan = False
            for i in range(INT8_BLOCK):
                v = x[t, k0 + i] / d if by_d else x[t, k0 + i] * inv
                nan |= v != v
                q = np.int32(np.rint(v)) if v == v else np.int32(0)
                codes[t * K + k0 + i] = q
                acc += q
                if i == INT8_BLOCK // 2 - 1:
                    halves[2 * (t * n32 + j)] = acc
            halves[2 * (t * n32 + j) + 1] = acc - np.int32(halves[2 * (t * n32 + j)])
            if nan:   # a NaN in the block (max|x| skips it): a NaN scale, so its products are NaN as in float32
                d = _F32(np.nan)
            s[xd + t * n32 + j] = d            # token-major: a superblock's 8 scales adjacent
            s[xs + t * n32 + j] = d * _F32(acc)


@njit(cache=True, inline="always")
def quantize_once(x, w, s):
    # quantize x into s unless s's key says this task did so for this x (address, T, K) and weight
    # w (address) since quant_scratch cleared the key: one quantization per task and product
    T, K = x.shape
    key = s[_KEY:_KEY + 8].view(np.int64)
    xa, wa = x.ctypes.data, w.ctypes.data
    if key[0] != xa or key[1] != wa or key[2] != T or key[3] != K:
        quantize_activations(x, s)
        key[0], key[1], key[2], key[3] = xa, wa, T, K


# ---- the vector code ----------------------------------------------------------------------------

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_FL, _HALF = ir.FloatType(), ir.HalfType()
_V32I8, _V16I16, _V8I32, _V8F = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, 8),
                                 ir.VectorType(_FL, 8))


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder, x, vt):
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, vt.count),
                                                                               [0] * vt.count))


def _c64(v):
    return ir.Constant(_I64, v)


def _udot(builder, codes, xv, acc=None):
    # <8 x i32>: acc (none: 0) plus the sums of 4 adjacent products codes[i] * x[i] (unsigned x
    # signed bytes). AVX2's vpmaddubsw saturates its int16 pair sums: callers keep |2 w x| < 2^15
    if ISA == "avx512vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I32,
                     [ir.Constant(_V8I32, [0] * 8) if acc is None else acc, builder.bitcast(codes, _V8I32),
                      builder.bitcast(xv, _V8I32)])
    p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [codes, xv])
    s = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [p, ir.Constant(_V16I16, [1] * 16)])
    return s if acc is None else builder.add(acc, s)


def _idot_signature(w, s):
    # the integer intrinsics' (w, woff, s, t0, T, K): uint8 weights, a float32 scratch row
    if not (isinstance(w, types.Array) and w.dtype == types.uint8 and isinstance(s, types.Array)
            and s.dtype == types.float32):
        return None
    return types.void(w, types.int64, s, types.int64, types.int64, types.int64)


def _scratch_layout(builder, Tv, Kv):
    """``quantize_activations``' layout in IR: ``(n32, xd0, xs0, xq0, xb0)``, the blocks per token
    and where the scales, the sums (float32 slots), the codes and the half sums (bytes) start."""
    n32 = builder.udiv(Kv, _c64(INT8_BLOCK))
    xd0 = _c64(_XD)
    xs0 = builder.add(xd0, builder.mul(Tv, n32))
    xq0 = builder.mul(builder.add(xs0, builder.mul(Tv, n32)), _c64(4))
    xb0 = builder.add(xq0, builder.mul(builder.mul(Tv, n32), _c64(INT8_BLOCK)))
    return n32, xd0, xs0, xq0, xb0


def _load(builder, ptr, off, ty):
    # a value of type ty at element offset off of ptr, unaligned
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), ty.as_pointer()), align=1)


def _k_codes(builder, ob, kind):
    """Q4_K / Q5_K: the 8 sub-blocks' codes (``<32 x i8>`` each, 0..15 or 0..31) of the superblock
    at ``ob`` (i8*): sub-block ``2c`` the low nibbles of ``qs[32c : 32c + 32]``, ``2c + 1`` the high
    ones; Q5_K's fifth bits from ``qh``."""
    qs0 = 16 if kind == "q4_k" else 48
    m15 = ir.Constant(_V32I8, [15] * 32)
    codes = []
    for c in range(4):
        q = _load(builder, ob, _c64(qs0 + 32 * c), _V16I16)
        codes.append(builder.and_(builder.bitcast(q, _V32I8), m15))
        codes.append(builder.and_(builder.bitcast(builder.lshr(q, ir.Constant(_V16I16, [4] * 16)), _V32I8), m15))
    if kind == "q5_k":
        qh = _load(builder, ob, _c64(16), _V32I8)
        codes = [builder.or_(codes[j], _q5k_high_bits(builder, qh, j)) for j in range(8)]
    return codes


def _q6k_codes(builder, ob):
    """Q6_K: the codes (``<32 x i8>``, 0..63) of the superblock at ``ob`` (i8*) by 32 values, in
    value order: values ``128 h + 32 g + l`` take their low 4 bits from ``ql[64 h + 32 (g & 1) + l]``
    (nibble ``g >> 1``) and their high 2 from ``qh[32 h + l] >> 2 g``."""
    codes = []
    for h in range(2):
        a = _load(builder, ob, _c64(64 * h), _V32I8)
        bq = _load(builder, ob, _c64(64 * h + 32), _V32I8)
        qh = _load(builder, ob, _c64(128 + 32 * h), _V32I8)
        for g in range(4):
            src = a if g % 2 == 0 else bq
            lo = builder.and_(src, ir.Constant(_V32I8, [15] * 32)) if g < 2 else \
                builder.lshr(src, ir.Constant(_V32I8, [4] * 32))
            hb = builder.and_(builder.lshr(qh, ir.Constant(_V32I8, [2 * g] * 32)), ir.Constant(_V32I8, [3] * 32))
            codes.append(builder.or_(lo, builder.shl(hb, ir.Constant(_V32I8, [4] * 32))))
    return codes


def _make_idot(kind: str, nt: int):
    """An intrinsic: the dot products of one weight row with ``nt`` tokens' quantized activations.

    ``(w, woff, s, t0, T, K)``: uint8 ``w`` (the row's blocks from byte ``woff``), float32 scratch
    ``s`` (``quantize_activations``'s layout for ``T`` tokens of ``K`` values), tokens ``t0 .. t0 + nt - 1``; writes the ``nt`` sums to ``s[_RES + i]``."""

    def impl(typingctx, w, woff, s, t0, T, K):
        sig = _idot_signature(w, s)
        if sig is None:
            return None

        def codegen(context, builder, sg, args):
            wv, woffv, sv, t0v, Tv, Kv = args
            wp = context.make_array(sg.args[0])(context, builder, wv).data                 # i8*
            sf = context.make_array(sg.args[2])(context, builder, sv).data                 # float*
            sbytes = builder.bitcast(sf, _I8.as_pointer())
            n32, xd0, xs0, xq0, _ = _scratch_layout(builder, Tv, Kv)
            # one set of accumulators per token; two for one token, blocks alternating between them
            # (the fused multiply-add chains of 4 cycles per block would bound a single set)
            sets = 2 if nt == 1 else 1
            acc_sets = [[cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(nt)]
                        for _ in range(sets)]
            vnt = ir.VectorType(_FL, nt)
            corr_sets = [cgutils.alloca_once_value(builder, ir.Constant(vnt, [0.0] * nt)) for _ in range(sets)]

            def load(ptr, off, ty):
                return _load(builder, ptr, off, ty)

            def half(off):
                return builder.fpext(load(wp, off, _HALF), _FL)

            def sf_at(off):
                return builder.load(builder.gep(sf, [off]))

            def block(j, accs, corr):
                offset = None      # the block's offset / min (times d_x sum q), or None
                pre = None         # (function of x -> <8 x i32>) for the non-plain types
                if kind == "q8_0":
                    base = builder.add(woffv, builder.mul(j, _c64(34)))
                    dw = half(base)
                    wq = load(wp, builder.add(base, _c64(2)), _V32I8)
                    codes = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [wq, wq])      # |w|

                    def pre(xv, wq=wq, codes=codes):
                        return _udot(builder, codes, _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, wq]))
                else:  # q4_0, q4_1
                    bb, qo = (18, 2) if kind == "q4_0" else (20, 4)
                    base = builder.add(woffv, builder.mul(j, _c64(bb)))
                    dw = half(base)
                    offset = builder.fmul(dw, ir.Constant(_FL, -8.0)) if kind == "q4_0" else \
                        half(builder.add(base, _c64(2)))
                    b16 = load(wp, builder.add(base, _c64(qo)), ir.VectorType(_I8, 16))
                    lo = builder.and_(b16, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
                    hi = builder.lshr(b16, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
                    codes = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
                # the nt tokens' activation scales (and sums) of block j, one vector each
                xdv, xsv = ir.Constant(vnt, ir.Undefined), ir.Constant(vnt, ir.Undefined)
                for i in range(nt):
                    sidx = builder.add(builder.mul(builder.add(t0v, _c64(i)), n32), j)
                    xdv = builder.insert_element(xdv, sf_at(builder.add(xd0, sidx)), ir.Constant(_I32, i))
                    xsv = builder.insert_element(xsv, sf_at(builder.add(xs0, sidx)), ir.Constant(_I32, i))
                scales = builder.fmul(_splat(builder, dw, vnt), xdv)
                if offset is not None:
                    builder.store(_call(builder, f"llvm.fma.v{nt}f32", vnt, [
                        _splat(builder, offset, vnt), xsv, builder.load(corr)]), corr)
                for i in range(nt):
                    t = builder.add(t0v, _c64(i))
                    tb = builder.add(builder.mul(t, n32), j)          # the token's block index
                    xv = load(sbytes, builder.add(xq0, builder.mul(tb, _c64(INT8_BLOCK))), _V32I8)
                    dot = pre(xv) if pre is not None else _udot(builder, codes, xv)
                    scale = builder.extract_element(scales, ir.Constant(_I32, i))
                    acc = builder.load(accs[i])
                    f = builder.sitofp(dot, _V8F)
                    builder.store(_call(builder, "llvm.fma.v8f32", _V8F, [f, _splat(builder, scale, _V8F), acc]),
                                  accs[i])
            # groups of 8 blocks: the 8 integer dot products of a token summed across their lanes
            # together (_hsum8), one conversion and one <8 x float> multiply-add per group
            bb = 34 if kind == "q8_0" else 18 if kind == "q4_0" else 20
            g_accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(nt)]
            g_corrs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(nt)]
            n_groups = builder.udiv(n32, _c64(8))
            with cgutils.for_range(builder, n_groups) as loop:
                g = loop.index
                gp = builder.gep(wp, [builder.add(woffv, builder.mul(g, _c64(8 * bb)))])
                dws, offs, codes, signs = ir.Constant(_V8F, ir.Undefined), ir.Constant(_V8F, ir.Undefined), [], []
                for i in range(8):
                    dw = builder.fpext(load(gp, _c64(bb * i), _HALF), _FL)
                    dws = builder.insert_element(dws, dw, ir.Constant(_I32, i))
                    if kind == "q8_0":
                        wq = load(gp, _c64(bb * i + 2), _V32I8)
                        signs.append(wq)
                        codes.append(_call(builder, "llvm.x86.avx2.psign.b", _V32I8, [wq, wq]))    # |w|
                    else:
                        qo = 2 if kind == "q4_0" else 4
                        off = builder.fmul(dw, ir.Constant(_FL, -8.0)) if kind == "q4_0" else \
                            builder.fpext(load(gp, _c64(bb * i + 2), _HALF), _FL)
                        offs = builder.insert_element(offs, off, ir.Constant(_I32, i))
                        b16 = load(gp, _c64(bb * i + qo), ir.VectorType(_I8, 16))
                        lo = builder.and_(b16, ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
                        hi = builder.lshr(b16, ir.Constant(ir.VectorType(_I8, 16), [4] * 16))
                        codes.append(builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32),
                                                                                 list(range(32)))))
                for i in range(nt):
                    blk = builder.add(builder.mul(builder.add(t0v, _c64(i)), n32), builder.mul(g, _c64(8)))
                    xb = builder.gep(sbytes, [builder.add(xq0, builder.mul(blk, _c64(INT8_BLOCK)))])
                    dots = []
                    for j in range(8):
                        xv = load(xb, _c64(INT8_BLOCK * j), _V32I8)
                        if kind == "q8_0":
                            xv = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, signs[j]])
                        dots.append(_udot(builder, codes[j], xv))
                    sums = builder.sitofp(_hsum8(builder, dots), _V8F)
                    dx = load(sf, builder.add(xd0, blk), _V8F)
                    builder.store(_call(builder, "llvm.fma.v8f32", _V8F, [
                        sums, builder.fmul(dws, dx), builder.load(g_accs[i])]), g_accs[i])
                    if kind != "q8_0":
                        builder.store(_call(builder, "llvm.fma.v8f32", _V8F, [
                            offs, load(sf, builder.add(xs0, blk), _V8F), builder.load(g_corrs[i])]), g_corrs[i])
            # the blocks after the last whole group, one at a time
            first = builder.mul(n_groups, _c64(8))
            rest = builder.sub(n32, first)
            with cgutils.for_range(builder, builder.udiv(rest, _c64(sets))) as loop:
                for k in range(sets):
                    block(builder.add(first, builder.add(builder.mul(loop.index, _c64(sets)), _c64(k))),
                          acc_sets[k], corr_sets[k])
            if sets == 2:
                with builder.if_then(builder.icmp_unsigned("!=", builder.urem(rest, _c64(2)), _c64(0))):
                    block(builder.sub(n32, _c64(1)), acc_sets[0], corr_sets[0])
            cv = builder.load(corr_sets[0])
            for k in range(1, sets):
                cv = builder.fadd(cv, builder.load(corr_sets[k]))
            for i in range(nt):
                acc, c = builder.load(acc_sets[0][i]), builder.extract_element(cv, ir.Constant(_I32, i))
                for k in range(1, sets):
                    acc = builder.fadd(acc, builder.load(acc_sets[k][i]))
                acc = builder.fadd(acc, builder.fadd(builder.load(g_accs[i]), builder.load(g_corrs[i])))
                total = builder.call(cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_FL, [_FL, _V8F]), "llvm.vector.reduce.fadd.v8f32"),
                    [ir.Constant(_FL, 0.0), acc], fastmath=("reassoc",))
                builder.store(builder.fadd(total, c), builder.gep(sf, [_c64(_RES + i)]))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_idot_{kind}_{nt}"
    return intrinsic(impl)


def _k_scales_v8(builder, b16):
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins as two ``<8 x i32>`` from the
    ``<16 x i8>`` ``b16`` whose first 12 bytes are the block's packed scales (``get_scale_min_k4``:
    sub-blocks 0..3 in the low 6 bits of bytes 0..3 / 4..7; 4..7 in the nibbles of bytes 8..11 with
    their top 2 bits in the top bits of bytes 0..3 / 4..7)."""
    v8 = ir.VectorType(_I8, 8)

    def pick(idx):
        return builder.shuffle_vector(b16, b16, ir.Constant(ir.VectorType(_I32, 8), idx))

    def c8(v):
        return ir.Constant(v8, [v] * 8)
    low = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 4 + [0] * 4)
    a = pick([0, 1, 2, 3, 8, 9, 10, 11])
    top_sc = builder.shl(builder.lshr(pick([0, 1, 2, 3, 0, 1, 2, 3]), c8(6)), c8(4))
    sc = builder.select(low, builder.and_(a, c8(63)), builder.or_(builder.and_(a, c8(15)), top_sc))
    m = pick([4, 5, 6, 7, 8, 9, 10, 11])
    top_m = builder.shl(builder.lshr(pick([4, 5, 6, 7, 4, 5, 6, 7]), c8(6)), c8(4))
    mn = builder.select(low, builder.and_(m, c8(63)), builder.or_(builder.lshr(m, c8(4)), top_m))
    v8i32 = ir.VectorType(_I32, 8)
    return builder.zext(sc, v8i32), builder.zext(mn, v8i32)


def _q5k_high_bits(builder, qh, sb):
    """Q5_K: ``<32 x i8>`` of bit 4 of the 32 codes of sub-block ``sb`` (bit ``sb`` of ``qh[l]`` for
    value ``l``, ``qh`` the block's 32 high-bit bytes), in place (``16`` or ``0``)."""
    v32i8 = ir.VectorType(_I8, 32)
    bit = builder.and_(qh, ir.Constant(v32i8, [1 << sb] * 32))
    return builder.shl(bit, ir.Constant(v32i8, [4 - sb] * 32)) if sb <= 4 else \
        builder.lshr(bit, ir.Constant(v32i8, [sb - 4] * 32))


def _lane_splat(builder, v, lane, n):
    # <n x T>: every lane lane ``lane`` of vector ``v``
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), [lane] * n))



def _hsum8(builder, dots):
    """``<8 x i32>`` whose lane ``j`` is the sum of the 8 lanes of ``dots[j]`` (8 ``<8 x i32>``): a
    tree of ``vphaddd`` (pairs within 128-bit halves), then the two halves added."""
    def hadd(a, b):
        return _call(builder, "llvm.x86.avx2.phadd.d", _V8I32, [a, b])
    p = [hadd(dots[2 * i], dots[2 * i + 1]) for i in range(4)]
    q0, q1 = hadd(p[0], p[1]), hadd(p[2], p[3])
    lo = builder.shuffle_vector(q0, q1, ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3, 8, 9, 10, 11]))
    hi = builder.shuffle_vector(q0, q1, ir.Constant(ir.VectorType(_I32, 8), [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.add(lo, hi)


def _make_idot_superblock(kind: str, nt: int):
    """``_make_idot``'s intrinsic for Q4_K, Q5_K or Q6_K, one 256-value superblock per loop trip: byte
    offsets inside the block constant, the block's scales decoded as vectors in registers, and the
    8 integer dot products of a token (one per 32-value activation block) summed across their lanes
    together (``_hsum8``), converted once and multiplied-added with the 8 products of weight and
    activation scales in one ``<8 x float>`` per token: per superblock and token one conversion and
    one multiply-add instead of eight. Q4_K's mins: ``dmin * m`` times the activations' block sums,
    one ``<8 x float>`` multiply-add per superblock and token."""

    def impl(typingctx, w, woff, s, t0, T, K):
        sig = _idot_signature(w, s)
        if sig is None:
            return None

        def codegen(context, builder, sg, args):
            wv, woffv, sv, t0v, Tv, Kv = args
            wp = context.make_array(sg.args[0])(context, builder, wv).data
            sf = context.make_array(sg.args[2])(context, builder, sv).data
            sbytes = builder.bitcast(sf, _I8.as_pointer())
            n32, xd0, xs0, xq0, xb0 = _scratch_layout(builder, Tv, Kv)
            v8f = ir.VectorType(_FL, 8)
            zero8 = ir.Constant(v8f, [0.0] * 8)
            accs = [cgutils.alloca_once_value(builder, zero8) for _ in range(nt)]
            kq = kind in ("q4_k", "q5_k")     # scales and mins (get_scale_min_k4)
            corrs = [cgutils.alloca_once_value(builder, zero8) for _ in range(nt)] if kq else []
            bb = {"q4_k": 144, "q5_k": 176, "q6_k": 210}[kind]

            def load(ptr, off, ty):
                return _load(builder, ptr, off, ty)

            with cgutils.for_range(builder, builder.udiv(n32, _c64(8))) as loop:
                b = loop.index
                ob = builder.gep(wp, [builder.add(woffv, builder.mul(b, _c64(bb)))])
                if kq:
                    d = builder.fpext(load(ob, _c64(0), _HALF), _FL)
                    dmin = builder.fpext(load(ob, _c64(2), _HALF), _FL)
                    sc, mn = _k_scales_v8(builder, load(ob, _c64(4), ir.VectorType(_I8, 16)))
                    wscale = builder.fmul(_splat(builder, d, v8f), builder.sitofp(sc, v8f))
                    wmin = builder.fmul(_splat(builder, dmin, v8f), builder.sitofp(mn, v8f))
                    codes = _k_codes(builder, ob, kind)

                    def dots_of(xb):
                        return [_udot(builder, codes[j], load(xb, _c64(32 * j), _V32I8)) for j in range(8)]
                else:  # q6_k
                    d = builder.fpext(load(ob, _c64(208), _HALF), _FL)
                    wscale = _splat(builder, d, v8f)
                    sc16 = builder.sext(load(ob, _c64(192), ir.VectorType(_I8, 16)), _V16I16)
                    codes, scv = _q6k_codes(builder, ob), []
                    for h in range(2):
                        for g in range(4):
                            s0 = 8 * h + 2 * g
                            scv.append(builder.shuffle_vector(sc16, sc16, ir.Constant(
                                ir.VectorType(_I32, 16), [s0] * 8 + [s0 + 1] * 8)))

                    def dots_of(xb):
                        # q x in int16 pairs (codes 0..63: |sums| <= 2 * 63 * 127 < 2^15), then
                        # times the two 16-value sub-blocks' scales into int32 pairs
                        return [_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [
                            _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16,
                                  [codes[j], load(xb, _c64(32 * j), _V32I8)]), scv[j]]) for j in range(8)]
                for i in range(nt):
                    blk = builder.add(builder.mul(builder.add(t0v, _c64(i)), n32), builder.mul(b, _c64(8)))
                    xb = builder.gep(sbytes, [builder.add(xq0, builder.mul(blk, _c64(INT8_BLOCK)))])
                    isum = _hsum8(builder, dots_of(xb))
                    if kind == "q6_k":
                        # minus 32 sc x: the 16 sub-blocks' scales times the sums of their 16
                        # activation codes, pairwise into the 8 blocks' lanes (one vpmaddwd)
                        half_sums = load(sbytes, builder.add(xb0, builder.mul(blk, _c64(4))), _V16I16)
                        off = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [sc16, half_sums])
                        isum = builder.sub(isum, builder.shl(off, ir.Constant(_V8I32, [5] * 8)))
                    sums = builder.sitofp(isum, v8f)
                    dx = load(sf, builder.add(xd0, blk), v8f)
                    builder.store(_call(builder, "llvm.fma.v8f32", v8f, [
                        sums, builder.fmul(wscale, dx), builder.load(accs[i])]), accs[i])
                    if kq:
                        builder.store(_call(builder, "llvm.fma.v8f32", v8f, [
                            wmin, load(sf, builder.add(xs0, blk), v8f), builder.load(corrs[i])]), corrs[i])
            for i in range(nt):
                acc = builder.load(accs[i])
                if kq:
                    acc = builder.fsub(acc, builder.load(corrs[i]))
                total = builder.call(cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(_FL, [_FL, v8f]), "llvm.vector.reduce.fadd.v8f32"),
                    [ir.Constant(_FL, 0.0), acc], fastmath=("reassoc",))
                builder.store(total, builder.gep(sf, [_c64(_RES + i)]))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"_idot_sb_{kind}_{nt}"
    return intrinsic(impl)



_idot_q8_0_1, _idot_q8_0_4 = _make_idot("q8_0", 1), _make_idot("q8_0", _NT)
_idot_q4_0_1, _idot_q4_0_4 = _make_idot("q4_0", 1), _make_idot("q4_0", _NT)
_idot_q4_1_1, _idot_q4_1_4 = _make_idot("q4_1", 1), _make_idot("q4_1", _NT)
_idot_q4_k_1, _idot_q4_k_4 = _make_idot_superblock("q4_k", 1), _make_idot_superblock("q4_k", _NT)
_idot_q5_k_1, _idot_q5_k_4 = _make_idot_superblock("q5_k", 1), _make_idot_superblock("q5_k", _NT)
_idot_q6_k_1, _idot_q6_k_4 = _make_idot_superblock("q6_k", 1), _make_idot_superblock("q6_k", _NT)


@intrinsic
def load_f16(typingctx, b, i):
    """The binary16 at bytes ``b[i], b[i + 1]`` (uint8 array) as float32, exactly (``fpext``: one
    ``vcvtph2ps`` with F16C, which every AVX2 CPU has)."""
    if not (isinstance(b, types.Array) and b.dtype == types.uint8):
        return None

    def codegen(context, builder, sg, args):
        data = context.make_array(sg.args[0])(context, builder, args[0]).data
        h = builder.load(builder.bitcast(builder.gep(data, [args[1]]), _HALF.as_pointer()), align=1)
        return builder.fpext(h, _FL)
    return types.float32(b, types.int64), codegen


@njit(cache=True)
def int8_rows(x, w, qtype, out, col0, s, r0, r1):
    """``out[:, col0 + r] ~= x @ dequantize(w[r])`` for ``r0 <= r < r1`` through the integer dot
    products, with ``x`` quantized into the scratch row ``s`` unless ``s``'s key says this task did
    so already for this ``x`` (its address, ``T``, ``K``) and weight ``w`` (its address) since
    ``quant_scratch`` cleared the key: one quantization per task and product. ``qtype`` one of
    ``INT8_TYPES``; ``K`` a multiple of 32 (every such type's rows are)."""
    T, K = x.shape
    quantize_once(x, w, s)
    rb = w.shape[1]
    for r in range(r0, r1):
        woff = r * rb
        t = 0
        while T - t >= _NT:
            if qtype == Q8_0:
                _idot_q8_0_4(w, woff, s, t, T, K)
            elif qtype == Q4_0:
                _idot_q4_0_4(w, woff, s, t, T, K)
            elif qtype == Q4_1:
                _idot_q4_1_4(w, woff, s, t, T, K)
            elif qtype == Q4_K:
                _idot_q4_k_4(w, woff, s, t, T, K)
            elif qtype == Q5_K:
                _idot_q5_k_4(w, woff, s, t, T, K)
            else:
                _idot_q6_k_4(w, woff, s, t, T, K)
            for i in range(_NT):
                out[t + i, col0 + r] = s[_RES + i]
            t += _NT
        while t < T:
            if qtype == Q8_0:
                _idot_q8_0_1(w, woff, s, t, T, K)
            elif qtype == Q4_0:
                _idot_q4_0_1(w, woff, s, t, T, K)
            elif qtype == Q4_1:
                _idot_q4_1_1(w, woff, s, t, T, K)
            elif qtype == Q4_K:
                _idot_q4_k_1(w, woff, s, t, T, K)
            elif qtype == Q5_K:
                _idot_q5_k_1(w, woff, s, t, T, K)
            else:
                _idot_q6_k_1(w, woff, s, t, T, K)
            out[t, col0 + r] = s[_RES]
            t += 1
