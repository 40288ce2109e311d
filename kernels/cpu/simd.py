"""Explicit vector code for paged attention's inner loops (decode blocks, prefill tiles), as LLVM IR from Numba.

Numba has no vector types: its loops become vector code only where LLVM's loop vectoriser
manages it, and for a decode's work on one 16-key block it does not. A score is a ``head_dim``
dot product that LLVM vectorises with partial sums and ends with a horizontal reduction of its
own (a dozen shuffles and adds per score, each as costly as the products); loops over the 16
keys of a block (the weights' ``exp2``, a row's ``P V``) are vectorised 16 lanes x 4 unrolled,
so a 16-element trip runs the scalar remainder loop instead. These intrinsics emit the vector
code directly, ``W`` float32 lanes (16 where Numba compiles for AVX-512, else 8), inlined into
the Numba caller like any ``@intrinsic`` (no call, no reference counting of the arrays):

* ``qk16``: one query row against 16 keys: 16 vector partial sums over ``head_dim``, then one
  transpose-and-add tree (pairs of vectors shuffled into halves and added, ``log2 W`` levels)
  that leaves the 16 scores in ``16 / W`` vectors: ~30 shuffles for 16 scores instead of a
  reduction per score.
* ``exp2_sum16``: the online softmax's weights ``2^(s - m)`` of 16 scores in place
  (the range reduction and polynomial of kernels/cpu/math.py's ``exp2``, lane-wise) and their sum.
* ``pv``: a row's ``acc += P V`` over ``n`` keys, ``4 W`` coordinates of ``acc`` (2 with AVX2)
  held in registers across the keys (one load and store of ``acc`` per block, not per key): one
  row of ``pv_rows``.
* ``qk16_rows`` / ``pv_rows``: ``qk16`` and ``pv`` for the query rows of one KV head (a GQA
  group) at once, each key or value vector loaded once for all the rows; every sum is the one-row
  sum, in the same order (the same bits).

For the prefill tiles (many query rows against a chunk of keys), small dense products with
register blocking as in a GEMM microkernel, in place of OpenBLAS's AVX2 kernels, which fall well
short of the core's rate on inner dimensions of 64-128:

* ``transpose_rows``: a chunk's key rows (scattered over the cache's blocks) into the columns
  of a ``[head_dim, chunk]`` buffer, ``W x W`` blocks transposed in registers.
* ``tile_scores``: ``S = Q K^T`` on the transposed keys, ``TILE_RB`` rows x 4 vectors of keys
  in accumulators (2 with AVX2's 16 registers), one broadcast ``q`` element per row and the key
  vectors per step of ``head_dim``.
* ``tile_pv``: ``acc += P V``, ``TILE_RB`` rows x 4 vectors (2 with AVX2) of ``acc`` in
  registers over the keys, the value rows read in place through their offsets.
* ``row_max`` / ``row_exp2``: a row's online-softmax maximum and weights in masked vectors.

Arguments are arrays with flat element offsets (C-contiguous data from the offset on, as the
kernels' caches and per-task buffers are) of float32 (another dtype fails to compile), except
the KV cache operands (``qk16``'s keys, ``pv``'s and ``tile_pv``'s values, ``transpose_rows``'
source), which may also be a 16-bit cache (bfloat16 bits as uint16, ``kernels/cpu/kv_dtype.py``):
its ``W`` elements are loaded as one half-width vector and widened to float32 in registers;
``head_dim`` must be a multiple of ``W``, which the caller checks. Sums are in float32 in a
blocked order (``head_dim / W`` terms per lane, then the tree), within the any-order bounds of
the tests.

Sources: the register-blocked microkernel of BLIS / GotoBLAS (Goto & van de Geijn, "Anatomy of
High-Performance Matrix Multiplication", ACM TOMS 2008; Van Zee & van de Geijn, "BLIS", 2015);
LLVM Language Reference (vector types, ``shufflevector``, ``llvm.fma``,
``llvm.vector.reduce.fadd``); Numba's ``@intrinsic`` (numba.readthedocs.io, "Low-level extension
API"); the transposed reduction of several dot products is the usual SIMD idiom of BLAS ``gemv``
kernels (e.g. OpenBLAS's ``sgemv_t`` microkernels).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .kv_dtype import storage_ir, widen
from .math import _C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7

__all__ = ["compiles_avx512", "W", "TILE_RB", "qk16", "pv", "exp2_sum16", "transpose_rows", "tile_scores", "tile_pv",
           "pv_rows", "PV_ROWS", "qk16_rows", "QK_ROWS", "row_max", "row_exp2"]


def compiles_avx512() -> bool:
    """Whether Numba compiles the kernels with AVX-512 (32 vector registers of 16 float32 lanes
    instead of AVX2's 16 of 8), read from the feature list its JIT passes to LLVM:
    ``NUMBA_CPU_FEATURES`` where set, else the host's (``numba.core.codegen``), the last
    ``+avx512f`` / ``-avx512f`` winning. Numba's on-disk cache keys its entries on that same list,
    so code cached under one answer never runs under the other. LLVM adds the CPU model's own
    features (``NUMBA_CPU_NAME``, else the host's) to an override: one that drops AVX-512 on an
    AVX-512 host should name an older CPU too (``NUMBA_CPU_NAME=haswell``), else the kernels take
    the AVX2 shape with AVX-512 code (slower, same results)."""
    from numba.core import codegen, config
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    wide = False
    for f in features.split(","):
        f = f.strip()
        if f[1:] == "avx512f" and f[:1] in "+-":
            wide = f[0] == "+"
    return wide


W = 16 if compiles_avx512() else 8
"""float32 lanes of the vectors these intrinsics use: one register of the level compiled for."""

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


def _f32_arrays(*arrays) -> bool:
    # the intrinsics read raw float32 data: any other dtype is a typing error, not wrong numbers
    return all(isinstance(a, types.Array) and a.dtype == types.float32 for a in arrays)


def _kv_array(a) -> bool:
    # a KV cache operand: float32, or a 16-bit cache widened as it is loaded (kv_dtype.py)
    return isinstance(a, types.Array) and a.dtype in (types.float32, types.uint16)


def _vload_kv(builder, base, off, ty):
    # W elements of a cache of element type ty at element offset off, as float32 lanes
    if ty == types.float32:
        return _vload(builder, base, off)
    vt = ir.VectorType(storage_ir(ty), W)
    return widen(builder, builder.load(builder.bitcast(builder.gep(base, [off]), vt.as_pointer()), align=2), ty)


def _vec(w):
    return ir.VectorType(_F32, w)


def _data(context, builder, aty, aval):
    return context.make_array(aty)(context, builder, aval).data


def _vload(builder, base, off):
    return builder.load(builder.bitcast(builder.gep(base, [off]), _vec(W).as_pointer()), align=4)


def _vstore(builder, val, base, off):
    builder.store(val, builder.bitcast(builder.gep(base, [off]), _vec(W).as_pointer()), align=4)


def _splat(builder, x):
    # a vector of W copies of the scalar x (of any type)
    vt = ir.VectorType(x.type, W)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, W), [0] * W))


def _call(builder, name, args, ret=None, fast=False):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret or args[0].type, [a.type for a in args]),
                                        name)
    return builder.call(fn, args, fastmath=("fast",) if fast else ())


def _fma(builder, a, b, c):
    return _call(builder, f"llvm.fma.v{W}f32", [a, b, c])


def _const(v):
    return ir.Constant(_vec(W), [float(v)] * W)


def _offset(builder, base, k):
    return builder.add(base, ir.Constant(_I64, k))


def _transpose_reduce(builder, accs):
    """``len(accs) / W`` vectors whose lanes, in order, are the lane sums of ``accs`` (a multiple
    of ``W`` vectors): pairs of vectors holding ``G`` keys x ``P`` partial sums each become one
    vector of ``2G`` keys x ``P/2`` (the first and second halves of each key's partials shuffled
    apart and added), until one partial per key is left."""
    vecs, P, G = list(accs), W, 1
    while P > 1:
        h = P // 2
        lo = [g * P + j for g in range(G) for j in range(h)]
        hi = [g * P + h + j for g in range(G) for j in range(h)]
        m_lo = ir.Constant(ir.VectorType(_I32, W), lo + [W + i for i in lo])
        m_hi = ir.Constant(ir.VectorType(_I32, W), hi + [W + i for i in hi])
        vecs = [builder.fadd(builder.shuffle_vector(a, b, m_lo), builder.shuffle_vector(a, b, m_hi), flags=("fast",))
                for a, b in zip(vecs[0::2], vecs[1::2])]
        P, G = h, 2 * G
    return vecs


@intrinsic
def qk16(typingctx, q, qoff, k, koff, kstride, D, s, soff):
    """``s[soff + o] = sum_d q[qoff + d] * k[koff + o * kstride + d]`` for the 16 keys ``o =
    0..15`` and ``d < D`` (flat float32 element offsets; ``D`` a multiple of ``W``)."""
    if not (_f32_arrays(q, s) and _kv_array(k)):
        return None
    sig = types.none(q, types.int64, k, types.int64, types.int64, types.int64, s, types.int64)

    def codegen(context, builder, sg, args):
        qa, qo, ka, ko, ks, d, sa, so = args
        qd, kd, sd = (_data(context, builder, sg.args[i], a) for i, a in ((0, qa), (2, ka), (6, sa)))
        slots = [cgutils.alloca_once_value(builder, _const(0.0)) for _ in range(16)]   # promoted to registers
        with cgutils.for_range(builder, builder.udiv(d, ir.Constant(_I64, W))) as loop:
            c = builder.mul(loop.index, ir.Constant(_I64, W))
            qv = _vload(builder, qd, builder.add(qo, c))
            for o in range(16):
                kv = _vload_kv(builder, kd, builder.add(builder.add(ko, builder.mul(ks, ir.Constant(_I64, o))), c),
                               sg.args[2].dtype)
                builder.store(_fma(builder, qv, kv, builder.load(slots[o])), slots[o])
        for i, v in enumerate(_transpose_reduce(builder, [builder.load(sl) for sl in slots])):
            _vstore(builder, v, sd, _offset(builder, so, i * W))
        return context.get_dummy_value()
    return sig, codegen


def _for_row_count(builder, rows, most, name, emit):
    # emit(nr) specialised for each row count nr = 1 .. most, chosen by the run-time ``rows`` (a
    # switch); any other count does nothing
    none = builder.function.append_basic_block(f"{name}.none")
    end = builder.function.append_basic_block(f"{name}.end")
    sw = builder.switch(rows, none)
    for nr in range(1, most + 1):
        bb = builder.function.append_basic_block(f"{name}.{nr}")
        sw.add_case(ir.Constant(_I64, nr), bb)
        builder.position_at_end(bb)
        emit(nr)
        builder.branch(end)
    builder.position_at_end(none)
    builder.branch(end)
    builder.position_at_end(end)


QK_ROWS = 4
"""The most query rows ``qk16_rows`` takes (a GQA group of 4 query heads per KV head, Llama 3's)."""
_QK_KEYS = W // QK_ROWS   # keys per pass: QK_ROWS x _QK_KEYS accumulators, reduced into one vector


@intrinsic
def qk16_rows(typingctx, q, qoff, ldq, rows, k, koff, kstride, D, s, soff, lds):
    """``s[soff + r lds + o] = sum_d q[qoff + r ldq + d] * k[koff + o * kstride + d]`` for ``r < rows``
    (1 .. ``QK_ROWS``; other counts do nothing), the 16 keys ``o`` and ``d < D`` (a multiple of
    ``W``): ``qk16`` for the query rows of one KV head (its GQA group) at once, each key vector
    loaded once for all the rows. ``QK_ROWS x W / QK_ROWS`` partial sums (rows x keys) at a time go
    through ``qk16``'s transpose-and-add tree into one vector; each score is summed as ``qk16``
    sums it (the same partial sums, added in the same tree order): the same bits."""
    if not (_f32_arrays(q, s) and _kv_array(k)):
        return None
    i64 = types.int64
    sig = types.none(q, i64, i64, i64, k, i64, i64, i64, s, i64, i64)

    def codegen(context, builder, sg, args):
        qa, qo, lq, rows_, ka, ko, ks, d, sa, so, ls = args
        qd, kd, sd = (_data(context, builder, sg.args[i], a) for i, a in ((0, qa), (4, ka), (8, sa)))
        nchunks = builder.udiv(d, ir.Constant(_I64, W))
        part = ir.VectorType(_F32, _QK_KEYS)

        def rows_block(nr):
            qrow = [builder.add(qo, builder.mul(lq, ir.Constant(_I64, i))) for i in range(nr)]
            # 16 / _QK_KEYS passes of _QK_KEYS keys, a loop (not unrolled: compile time)
            with cgutils.for_range(builder, ir.Constant(_I64, 16 // _QK_KEYS)) as passes:
                k0 = builder.mul(passes.index, ir.Constant(_I64, _QK_KEYS))
                slots = [[cgutils.alloca_once_value(builder, _const(0.0)) for _ in range(_QK_KEYS)] for _ in range(nr)]
                with cgutils.for_range(builder, nchunks) as loop:
                    c = builder.mul(loop.index, ir.Constant(_I64, W))
                    krow = [builder.add(ko, builder.mul(ks, builder.add(k0, ir.Constant(_I64, j))))
                            for j in range(_QK_KEYS)]
                    kv = [_vload_kv(builder, kd, builder.add(kr, c), sg.args[4].dtype) for kr in krow]
                    for i in range(nr):
                        qv = _vload(builder, qd, builder.add(qrow[i], c))
                        for j in range(_QK_KEYS):
                            builder.store(_fma(builder, qv, kv[j], builder.load(slots[i][j])), slots[i][j])
                accs = [builder.load(slots[i][j]) if i < nr else _const(0.0)
                        for i in range(QK_ROWS) for j in range(_QK_KEYS)]
                sums, = _transpose_reduce(builder, accs)   # lane i * _QK_KEYS + j: row i, key k0 + j
                for i in range(nr):
                    lanes = ir.Constant(ir.VectorType(_I32, _QK_KEYS), [i * _QK_KEYS + j for j in range(_QK_KEYS)])
                    at = builder.add(so, builder.add(builder.mul(ls, ir.Constant(_I64, i)), k0))
                    builder.store(builder.shuffle_vector(sums, ir.Constant(sums.type, ir.Undefined), lanes),
                                  builder.bitcast(builder.gep(sd, [at]), part.as_pointer()), align=4)

        _for_row_count(builder, rows_, QK_ROWS, "qk16_rows", rows_block)
        return context.get_dummy_value()
    return sig, codegen


@njit(inline="always")
def pv(p, poff, n, v, voff, vstride, D, acc, aoff):
    """``acc[aoff + d] += sum_{o < n} p[poff + o] * v[voff + o * vstride + d]`` for ``d < D`` (a
    multiple of ``W``): one row of ``pv_rows`` (its coordinates in registers over the ``n`` keys)."""
    pv_rows(p, poff, 0, 1, n, v, voff, vstride, D, acc, aoff, 0)


def _exp2(builder, x):
    # kernels/cpu/math.py's exp2 lane-wise: clamp to [-126, 126], k = floor(x + 1/2), f = x - k, 2^f from the
    # degree-7 Taylor series of e^(f ln 2) by Horner's rule with fused multiply-adds, times 2^k
    # built in the exponent bits
    x = _call(builder, f"llvm.minnum.v{W}f32", [_call(builder, f"llvm.maxnum.v{W}f32", [x, _const(-126.0)]),
                                                 _const(126.0)])
    k = _call(builder, f"llvm.floor.v{W}f32", [builder.fadd(x, _const(0.5))])
    f = builder.fsub(x, k)
    p = _const(_C7)
    for c in (_C6, _C5, _C4, _C3, _C2, _C1, _C0):
        p = _fma(builder, p, f, _const(c))
    iv = ir.VectorType(_I32, W)
    bits = builder.shl(builder.add(builder.fptosi(k, iv), ir.Constant(iv, [127] * W)), ir.Constant(iv, [23] * W))
    return builder.fmul(p, builder.bitcast(bits, _vec(W)))


@intrinsic
def exp2_sum16(typingctx, s, soff, m):
    """``s[soff + o] = 2^(s[soff + o] - m)`` for ``o = 0..15`` (kernels/cpu/math.py's ``exp2``, lane-wise);
    returns the float32 sum of the 16 weights."""
    if not _f32_arrays(s):
        return None
    sig = types.float32(s, types.int64, types.float32)

    def codegen(context, builder, sg, args):
        sa, so, mv = args
        sd = _data(context, builder, sg.args[0], sa)
        mv = _splat(builder, mv)
        total = None
        for i in range(16 // W):
            off = _offset(builder, so, i * W)
            w = _exp2(builder, builder.fsub(_vload(builder, sd, off), mv))
            _vstore(builder, w, sd, off)
            total = w if total is None else builder.fadd(total, w, flags=("fast",))
        return _call(builder, f"llvm.vector.reduce.fadd.v{W}f32", [ir.Constant(_F32, 0.0), total], ret=_F32,
                     fast=True)
    return sig, codegen


# Register blocking of the prefill tiles' products (tile_scores, tile_pv): TILE_RB rows at a
# time, each against _QK_CB vectors of keys (scores) or _PV_DB vectors of head_dim (P V):
# 4 x 4 = 16 accumulators of the 32 AVX-512 registers, 4 x 2 = 8 of AVX2's 16.
TILE_RB = 6
_QK_CB = 4 if W == 16 else 2
_PV_DB = 4 if W == 16 else 2


def _row_blocks(builder, rows, emit):
    # emit(r0, nr) for row blocks of TILE_RB rows, then the remaining rows one at a time
    full = builder.udiv(rows, ir.Constant(_I64, TILE_RB))
    with cgutils.for_range(builder, full) as loop:
        emit(builder.mul(loop.index, ir.Constant(_I64, TILE_RB)), TILE_RB)
    done = builder.mul(full, ir.Constant(_I64, TILE_RB))
    with cgutils.for_range(builder, builder.sub(rows, done)) as loop:
        emit(builder.add(done, loop.index), 1)


def _vector_groups(builder, nvec, width, emit):
    # emit(c0, nv) over nvec vectors: groups of width vectors (c0 in elements), then single ones
    full = builder.udiv(nvec, ir.Constant(_I64, width))
    with cgutils.for_range(builder, full) as loop:
        emit(builder.mul(loop.index, ir.Constant(_I64, width * W)), width)
    done = builder.mul(full, ir.Constant(_I64, width))
    with cgutils.for_range(builder, builder.sub(nvec, done)) as loop:
        emit(builder.mul(builder.add(done, loop.index), ir.Constant(_I64, W)), 1)


@intrinsic
def tile_scores(typingctx, q, qoff, ldq, rows, kt, ktoff, ldkt, ncols, D, s, soff, lds):
    """``s[soff + r lds + c] = sum_{d < D} q[qoff + r ldq + d] * kt[ktoff + d ldkt + c]`` for ``r <
    rows``, ``c < ncols`` (a multiple of ``W``): a prefill tile's ``S = Q K^T`` with the keys
    transposed (``kt [D, ldkt]``, keys along the vectors), ``TILE_RB`` rows x ``4 W`` keys of
    ``S`` in registers while ``d`` runs, each ``q`` element broadcast (no horizontal sums)."""
    if not _f32_arrays(q, kt, s):
        return None
    i64 = types.int64
    sig = types.none(q, i64, i64, i64, kt, i64, i64, i64, i64, s, i64, i64)

    def codegen(context, builder, sg, args):
        qa, qo, lq, rows_, ka, kto, lk, nc, d, sa, so, ls = args
        qd, kd, sd = (_data(context, builder, sg.args[i], a) for i, a in ((0, qa), (4, ka), (9, sa)))

        def block(r0, nr, c0, nv):
            slots = [[cgutils.alloca_once_value(builder, _const(0.0)) for _ in range(nv)] for _ in range(nr)]
            qrow = [builder.add(qo, builder.mul(builder.add(r0, ir.Constant(_I64, i)), lq)) for i in range(nr)]
            with cgutils.for_range(builder, d) as loop:
                kbase = builder.add(builder.add(builder.mul(loop.index, lk), c0), kto)
                kv = [_vload(builder, kd, _offset(builder, kbase, j * W)) for j in range(nv)]
                for i in range(nr):
                    qb = _splat(builder, builder.load(builder.gep(qd, [builder.add(qrow[i], loop.index)])))
                    for j in range(nv):
                        builder.store(_fma(builder, qb, kv[j], builder.load(slots[i][j])), slots[i][j])
            for i in range(nr):
                srow = builder.add(so, builder.add(builder.mul(builder.add(r0, ir.Constant(_I64, i)), ls), c0))
                for j in range(nv):
                    _vstore(builder, builder.load(slots[i][j]), sd, _offset(builder, srow, j * W))

        def rows_block(r0, nr):
            _vector_groups(builder, builder.udiv(nc, ir.Constant(_I64, W)), _QK_CB,
                           lambda c0, nv: block(r0, nr, c0, nv))
        _row_blocks(builder, rows_, rows_block)
        return context.get_dummy_value()
    return sig, codegen


def _pv_block(builder, pd, po, lp, vd, vty, vrow, ad, ao, la, nn, r0, nr, c0, nv):
    # acc rows r0 .. r0 + nr, coordinates c0 .. c0 + nv W, in registers over the nn keys: each value
    # vector (vrow(j): key j's flat offset) loaded once for the nr rows, each weight broadcast
    arow = [builder.add(ao, builder.add(builder.mul(builder.add(r0, ir.Constant(_I64, i)), la), c0)) for i in range(nr)]
    prow = [builder.add(po, builder.mul(builder.add(r0, ir.Constant(_I64, i)), lp)) for i in range(nr)]
    slots = [[cgutils.alloca_once_value(builder, _vload(builder, ad, _offset(builder, arow[i], j * W)))
              for j in range(nv)] for i in range(nr)]
    with cgutils.for_range(builder, nn) as loop:
        vbase = builder.add(vrow(loop.index), c0)
        vv = [_vload_kv(builder, vd, _offset(builder, vbase, j * W), vty) for j in range(nv)]
        for i in range(nr):
            w = _splat(builder, builder.load(builder.gep(pd, [builder.add(prow[i], loop.index)])))
            for j in range(nv):
                builder.store(_fma(builder, w, vv[j], builder.load(slots[i][j])), slots[i][j])
    for i in range(nr):
        for j in range(nv):
            _vstore(builder, builder.load(slots[i][j]), ad, _offset(builder, arow[i], j * W))


@intrinsic
def tile_pv(typingctx, p, poff, ldp, rows, n, v, voffs, D, acc, aoff, lda):
    """``acc[aoff + r lda + d] += sum_{j < n} p[poff + r ldp + j] * v[voffs[j] + d]`` for ``r <
    rows``, ``d < D`` (a multiple of ``W``): a prefill tile's ``acc += P V`` with the value rows
    read in place (``voffs``: int64 flat offset of key ``j``'s value row), ``TILE_RB`` rows x
    ``4 W`` coordinates of ``acc`` in registers over the ``n`` keys, each weight broadcast."""
    if not (_f32_arrays(p, acc) and _kv_array(v) and isinstance(voffs, types.Array) and voffs.dtype == types.int64):
        return None
    i64 = types.int64
    sig = types.none(p, i64, i64, i64, i64, v, voffs, i64, acc, i64, i64)

    def codegen(context, builder, sg, args):
        pa, po, lp, rows_, nn, va, oa, d, aa, ao, la = args
        pd, vd, ad = (_data(context, builder, sg.args[i], a) for i, a in ((0, pa), (5, va), (8, aa)))
        od = _data(context, builder, sg.args[6], oa)

        def vrow(j):
            return builder.load(builder.gep(od, [j]))

        def rows_block(r0, nr):
            _vector_groups(builder, builder.udiv(d, ir.Constant(_I64, W)), _PV_DB,
                           lambda c0, nv: _pv_block(builder, pd, po, lp, vd, sg.args[5].dtype, vrow, ad, ao, la, nn,
                                                    r0, nr, c0, nv))
        _row_blocks(builder, rows_, rows_block)
        return context.get_dummy_value()
    return sig, codegen


PV_ROWS = 4
"""The most rows ``pv_rows`` takes (a GQA group of 4; larger groups are taken 4 rows at a time)."""


@intrinsic
def pv_rows(typingctx, p, poff, ldp, rows, n, v, voff, vstride, D, acc, aoff, lda):
    """``acc[aoff + r lda + d] += sum_{j < n} p[poff + r ldp + j] * v[voff + j vstride + d]`` for ``r <
    rows`` (1 .. ``PV_ROWS``), ``d < D`` (a multiple of ``W``): a decode's ``acc += P V`` for the
    query rows of one KV head (its GQA group), the value rows read in place at a stride, all
    ``rows`` x ``4 W`` coordinates (2 W with AVX2) in registers over the keys, so that each value
    vector is loaded once for the group, not once per row. Each element's sum is the one-row
    sum, in the same order (a fused multiply-add per key): the same bits."""
    if not (_f32_arrays(p, acc) and _kv_array(v)):
        return None
    i64 = types.int64
    sig = types.none(p, i64, i64, i64, i64, v, i64, i64, i64, acc, i64, i64)

    def codegen(context, builder, sg, args):
        pa, po, lp, rows_, nn, va, vo, vs, d, aa, ao, la = args
        pd, vd, ad = (_data(context, builder, sg.args[i], a) for i, a in ((0, pa), (5, va), (9, aa)))

        def vrow(j):
            return builder.add(vo, builder.mul(vs, j))

        zero = ir.Constant(_I64, 0)
        nvec = builder.udiv(d, ir.Constant(_I64, W))
        _for_row_count(builder, rows_, PV_ROWS, "pv_rows",
                       lambda nr: _vector_groups(builder, nvec, _PV_DB,
                                                 lambda c0, nv: _pv_block(builder, pd, po, lp, vd, sg.args[5].dtype,
                                                                          vrow, ad, ao, la, nn, zero, nr, c0, nv)))
        return context.get_dummy_value()
    return sig, codegen


def _transpose(builder, rows):
    """The ``W x W`` transpose of ``W`` vectors: for each bit ``h`` of the lane index, rows ``i``
    and ``i + h`` (``i & h == 0``) exchange their off-diagonal ``h``-lane blocks (element ``(i,
    k + h)`` with ``(i + h, k)``); after every bit, vector ``i`` holds lane ``i`` of each row."""
    rows, h = list(rows), 1
    while h < W:
        lo = ir.Constant(ir.VectorType(_I32, W), [k if k & h == 0 else W + k - h for k in range(W)])
        hi = ir.Constant(ir.VectorType(_I32, W), [k + h if k & h == 0 else W + k for k in range(W)])
        for i in range(W):
            if i & h == 0:
                a, b = rows[i], rows[i + h]
                rows[i], rows[i + h] = builder.shuffle_vector(a, b, lo), builder.shuffle_vector(a, b, hi)
        h *= 2
    return rows


@intrinsic
def transpose_rows(typingctx, src, offs, n, D, dst, ldd):
    """``dst[d ldd + j] = src[offs[j] + d]`` for ``j < n`` (a multiple of ``W``) and ``d < D`` (a
    multiple of ``W``): rows scattered in ``src`` (int64 flat offsets ``offs``) into the columns
    of ``dst``, ``W x W`` blocks transposed in registers (``W`` loads, ``W log2 W`` two-input
    shuffles and ``W`` stores per block) where element-wise copies cost a store per element and,
    with ``ldd`` a multiple of 512 bytes, kept every store in the same few L1 sets."""
    if not (_f32_arrays(dst) and _kv_array(src) and isinstance(offs, types.Array) and offs.dtype == types.int64):
        return None
    i64 = types.int64
    sig = types.none(src, offs, i64, i64, dst, i64)

    def codegen(context, builder, sg, args):
        sa, oa, nn, d, da, ld = args
        sd, od, dd = (_data(context, builder, sg.args[i], a) for i, a in ((0, sa), (1, oa), (4, da)))
        wc = ir.Constant(_I64, W)
        with cgutils.for_range(builder, builder.udiv(nn, wc)) as jl:
            j0 = builder.mul(jl.index, wc)
            bases = [builder.load(builder.gep(od, [_offset(builder, j0, i)])) for i in range(W)]
            with cgutils.for_range(builder, builder.udiv(d, wc)) as dl:
                d0 = builder.mul(dl.index, wc)
                cols = _transpose(builder, [_vload_kv(builder, sd, builder.add(b, d0), sg.args[0].dtype) for b in bases])
                for k, v in enumerate(cols):
                    _vstore(builder, v, dd, builder.add(builder.mul(_offset(builder, d0, k), ld), j0))
        return context.get_dummy_value()
    return sig, codegen


def _lane_mask(builder, start, n):
    # lanes start + k < n of a vector starting at element start
    idx = builder.add(_splat(builder, start), ir.Constant(ir.VectorType(_I64, W), list(range(W))))
    return builder.icmp_signed("<", idx, _splat(builder, n))


@intrinsic
def row_max(typingctx, s, soff, n, init):
    """``max(init, s[soff], ..., s[soff + n - 1])`` (float32) in vectors of ``W``; the last
    vector's lanes past ``n`` are read (they must lie in the array) and ignored."""
    if not _f32_arrays(s):
        return None
    sig = types.float32(s, types.int64, types.int64, types.float32)

    def codegen(context, builder, sg, args):
        sa, so, nn, init = args
        sd = _data(context, builder, sg.args[0], sa)
        wc = ir.Constant(_I64, W)
        acc = cgutils.alloca_once_value(builder, _splat(builder, init))
        nvec = builder.udiv(builder.add(nn, ir.Constant(_I64, W - 1)), wc)
        with cgutils.for_range(builder, nvec) as loop:
            c = builder.mul(loop.index, wc)
            x = builder.select(_lane_mask(builder, c, nn), _vload(builder, sd, builder.add(so, c)),
                               _splat(builder, init))
            builder.store(_call(builder, f"llvm.maxnum.v{W}f32", [builder.load(acc), x]), acc)
        return _call(builder, f"llvm.vector.reduce.fmax.v{W}f32", [builder.load(acc)], ret=_F32, fast=True)
    return sig, codegen


@intrinsic
def row_exp2(typingctx, s, soff, nv, n, m):
    """``s[soff + j] = 2^(s[soff + j] - m)`` for ``j < nv`` and ``0`` for ``nv <= j < n``, in
    vectors of ``W`` (kernels/cpu/math.py's ``exp2`` lane-wise; the last vector is written whole: the
    array must extend to ``n`` rounded up to ``W``); returns the float32 sum of the weights."""
    if not _f32_arrays(s):
        return None
    sig = types.float32(s, types.int64, types.int64, types.int64, types.float32)

    def codegen(context, builder, sg, args):
        sa, so, nvv, nn, mv = args
        sd = _data(context, builder, sg.args[0], sa)
        wc = ir.Constant(_I64, W)
        mvec = _splat(builder, mv)
        total = cgutils.alloca_once_value(builder, _const(0.0))
        nvec = builder.udiv(builder.add(nn, ir.Constant(_I64, W - 1)), wc)
        with cgutils.for_range(builder, nvec) as loop:
            c = builder.mul(loop.index, wc)
            off = builder.add(so, c)
            e = _exp2(builder, builder.fsub(_vload(builder, sd, off), mvec))
            w = builder.select(_lane_mask(builder, c, nvv), e, _const(0.0))
            _vstore(builder, w, sd, off)
            builder.store(builder.fadd(builder.load(total), w, flags=("fast",)), total)
        return _call(builder, f"llvm.vector.reduce.fadd.v{W}f32", [ir.Constant(_F32, 0.0), builder.load(total)],
                     ret=_F32, fast=True)
    return sig, codegen
