"""Q4_K, Q6_K, Q8_0, Q4_0 and Q4_1 weight rows interleaved by 8, multiplied with int8 activations:
the integer path's layout for these types (the layers, lm_head and the embedding table with
int8 activations, the default for quantized GGUF files), as llama.cpp's CPU "repack" buffers (``block_q4_Kx8``,
``block_q8_0x4``).

``quant_int8``'s Q4_K kernel reads one row at a time: each 256-bit integer product holds 32 values
of one row, so a token's 8 block sums of a superblock must be summed across lanes (``_hsum8``) and
the codes unpacked once per row. Here 8 rows are stored interleaved, 4 bytes of each row side by
side, so one 256-bit ``vpdpbusd`` multiplies 4 values of each of 8 rows with the same 4 activation
codes (a 32-bit broadcast): the 8 lanes are the 8 rows' sums, no horizontal sum is taken, and a
sub-block's scales and mins are a vector over the 8 rows. Per superblock and token: 16 integer
products (8 with AVX-512 VNNI ``vpdpbusd``, per 256-bit half 2 with AVX2 ``vpmaddubsw`` +
``vpmaddwd``), and per 32-value sub-block one conversion and two multiply-adds for all 8 rows. The
results of 8 rows are stored as one vector.

Q8_0 (``repack_q8_0_x8``, the same size as the GGUF rows): per group of 8 rows and 32-value block
the 8 rows' ``d``, then the codes 4 bytes per row side by side, stored plus 128 as unsigned bytes
(``vpdpbusd`` multiplies unsigned by signed bytes); the ``128 sum q_x`` this adds is taken off in
int32 with the activations' block sums, so the integer sum is exact as in the row kernel. With AVX2
(``vpmaddubsw``, whose int16 pair sums saturate: ``2 * 255 * 127 > 2^15 - 1``) the codes are taken
back to signed bytes in registers and multiplied as ``|w|`` times ``x`` with ``w``'s sign
(``vpsignb``), as the row kernel does (pair sums at most ``2 * 128 * 127``).

Q6_K (``repack_q6_k_x8``, the same size as the GGUF rows; its table there): per 16-value
sub-block and token the 8 rows' integer sums of codes 0..63, then per 32 values ``sc_a (s_a - 32
h_a) + sc_b (s_b - 32 h_b)`` in int32 with the activations' half sums ``h`` (exact, below 2^24),
one conversion and one multiply-add with ``d_w d_x``. Its code chunks are stored in the order the
kernel first reads them (every first touch of a cache line above the last: 26-28 G
multiply-adds/s from DRAM on one thread, against 6-8 with the low and high bits as two regions).
Q4_0 / Q4_1 (``repack_q4_x8``, the same sizes): the 8 rows' ``d`` (and ``m``), then each row's 16
code bytes as GGUF packs them, 4 bytes per row side by side; Q4_0's ``-8`` taken off in int32.
``x8_decode_rows`` reads a row back out of any of these layouts (the embedding lookup of an
interleaved table), bit-exact with ``dequantize``.

Q4_K layout (``repack_q4_k_x8``): per group of 8 rows (``N % 8 == 0``) and superblock, ``X8_BLOCK_BYTES``
= 1184 bytes (the 8 rows' 8 x 144 = 1152, plus the scales and mins decoded to bytes):

  ====== ========= ===========================================================================
  bytes  field     meaning
  ====== ========= ===========================================================================
  0      d[8]      each row's f16 ``d``
  16     dmin[8]   each row's f16 ``dmin``
  32     sc[8][8]  ``sc[j][r]``: sub-block ``j``'s 6-bit scale of row ``r`` (``get_scale_min_k4``)
  96     m[8][8]   ``m[j][r]``: its 6-bit min
  160    qs        for ``p`` in 0..3, ``c`` in 0..7: 32 bytes, row ``r``'s ``qs[32 p + 4 c : + 4]`` at
                   ``4 r``: low nibbles values ``64 p + 4 c + i`` (sub-block ``2 p``), high nibbles
                   ``64 p + 32 + 4 c + i`` (sub-block ``2 p + 1``)
  ====== ========= ===========================================================================

A row of the product is then ``sum_j d sc_j (sum_i q_i x_i) - dmin m_j (sum_i x_i)`` with the
activations ``quant_int8.quantize_activations`` wrote (per token and 32 values: scale ``d_x``, codes,
``d_x sum codes``): per sub-block ``fma(float(isum), d sc * d_x, acc)`` and ``fma(dmin m, d_x sum q,
corr)``, ``acc - corr`` at the end. The same terms as ``quant_int8``'s Q4_K kernel (the same
activations, the integer sums exact), summed in another order: the results agree to float32
rounding (``tests/kernels/test_quant_int8.py`` checks both against the same derived bounds).

It takes every token count, prefill chunks included (the row kernel hands more than
``INT8_MAX_TOKENS`` tokens to float32 tiles and sgemm).

Sources: llama.cpp ``ggml/src/ggml-cpu/repack.cpp`` (``block_q4_Kx8``, ``make_block_q4_Kx8``: the
idea of interleaving rows so a product's lanes are rows), ``arch/x86/repack.cpp``
(``ggml_gemv_q4_K_8x8_q8_K``); Intel's intrinsics guide (``vpdpbusd``, ``vpbroadcastd``). The layout
above is this module's own (scales and mins as bytes, 4-byte interleave).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..quant_reference import QUANT_TYPES, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, _k_scale_min
from .memory import huge_page_zeros, release_mapped_pages
from .compile_jobs import NumbaJob
from .quant_int8 import (_FL, _HALF, _I8, _I16, _I32, _V8F, _V8I32, _V16I16, _V32I8, INT8_BLOCK, ISA, _c64, _call, _load,
                         _scratch_layout, _splat, _udot, load_f16, quantize_once)

__all__ = ["X8_ROWS", "X8_BLOCK_BYTES", "X8_Q8_0_BLOCK_BYTES", "X8_Q6_K_BLOCK_BYTES", "X8_Q4_0_BLOCK_BYTES",
           "X8_Q4_1_BLOCK_BYTES", "repack_q4_k_x8", "repack_q8_0_x8", "repack_q6_k_x8", "repack_q4_x8", "x8_rows",
           "x8_row_bytes", "x8_decode_rows"]

X8_ROWS = 8              # rows interleaved
X8_BLOCK_BYTES = 1184    # Q4_K: bytes per group of 8 rows and 256-value superblock
X8_Q8_0_BLOCK_BYTES = 272   # Q8_0: bytes per group of 8 rows and 32-value block (8 x 34, the same)
X8_Q6_K_BLOCK_BYTES = 1680  # Q6_K: bytes per group of 8 rows and superblock (8 x 210, the same)
X8_Q4_0_BLOCK_BYTES = 144   # Q4_0: bytes per group of 8 rows and 32-value block (8 x 18, the same)
X8_Q4_1_BLOCK_BYTES = 160   # Q4_1: the same (8 x 20)
_Q4K_BYTES = QUANT_TYPES[Q4_K].block_bytes   # 144
_Q80_BYTES = QUANT_TYPES[Q8_0].block_bytes   # 34
_Q6K_BYTES = QUANT_TYPES[Q6_K].block_bytes   # 210
_Q40_BYTES = QUANT_TYPES[Q4_0].block_bytes   # 18
_Q41_BYTES = QUANT_TYPES[Q4_1].block_bytes   # 20
# where the interleaved Q6_K layout's 32-byte code chunks start in a group's superblock: in the
# order the kernel first reads them, every first touch of a cache line at a higher address than the
# last
@njit(cache=True, inline="always")
def _q6k_ql_at(p, c):
    return 144 + 768 * (p // 2) + (512 + 128 * (c // 4) if p % 2 else 256 * (c // 4)) + 32 * (c % 4)


@njit(cache=True, inline="always")
def _q6k_qh_at(h, c):
    return 144 + 768 * h + 128 + 256 * (c // 4) + 32 * (c % 4)


@njit(cache=True)
def x8_row_bytes(K):
    """Bytes per weight row in the interleaved Q4_K layout (an eighth of a group's): ``K / 256 *
    148`` (the Q8_0 layout's rows are Q8_0's own size)."""
    return K // 256 * (X8_BLOCK_BYTES // X8_ROWS)


_CHUNK_BYTES = 4 << 20   # source bytes repacked at a time: the temporaries stay a few times that


def _repack(w: np.ndarray, name: str, block_bytes: int, group_bytes: int, d_at: int, fill, release: bool):
    # the output [G, nb, group_bytes] as [N, nb * group_bytes], filled about _CHUNK_BYTES of w at a
    # time: the 8 rows' f16 d (at byte d_at of a block) in a group block's first 16 bytes (every
    # layout starts so), the rest by fill(blocks [g, nb, 8 rows, block_bytes], out [g, nb,
    # group_bytes]). The output is on transparent huge pages where the system allows
    # (memory.huge_page_zeros: a decode step streams every weight once). With release, the source
    # rows' pages of a read-only mapped file are handed back as they are done
    # (memory.release_mapped_pages): at most a chunk of them resident beside the copy
    N, rb = w.shape
    if N % X8_ROWS or rb % block_bytes:
        raise ValueError(f"{name} x8 needs rows in groups of {X8_ROWS} and whole {block_bytes}-byte blocks, "
                         f"got {w.shape}")
    G, nb = N // X8_ROWS, rb // block_bytes
    out = huge_page_zeros((G, nb, group_bytes), np.uint8)
    step = max(1, _CHUNK_BYTES // (X8_ROWS * rb))
    for g0 in range(0, G, step):
        g1 = min(G, g0 + step)
        rows = w[X8_ROWS * g0:X8_ROWS * g1]
        b = np.asarray(rows).reshape(g1 - g0, X8_ROWS, nb, block_bytes).transpose(0, 2, 1, 3)
        o = out[g0:g1]
        o[:, :, 0:16] = b[:, :, :, d_at:d_at + 2].reshape(g1 - g0, nb, 16)
        fill(b, o)
        if release:
            release_mapped_pages(rows)
    if release:
        release_mapped_pages(w)   # the pages the chunks shared
    return out.reshape(N, -1)


def repack_q4_k_x8(w: np.ndarray, release: bool = False) -> np.ndarray:
    """Q4_K rows ``w`` (uint8 ``[N, K / 256 * 144]``, GGUF's blocks) -> the interleaved layout above,
    uint8 ``[N, x8_row_bytes(K)]`` (row ``8 g``'s slot starts group ``g``; C-contiguous, new memory).
    ``release``: hand ``w``'s pages back where it is a read-only mapped file (``_repack``).

    Raises:
        ValueError: ``N`` is not a multiple of 8 or ``w`` is not whole Q4_K rows.
    """
    def fill(b, out):
        G, nb = out.shape[:2]
        out[:, :, 16:32] = b[:, :, :, 2:4].reshape(G, nb, 16)
        sc, m = _k_scale_min(np.ascontiguousarray(b[:, :, :, 4:16]).reshape(-1, 12))   # [G nb r, j]
        out[:, :, 32:96] = sc.reshape(G, nb, X8_ROWS, 8).transpose(0, 1, 3, 2).reshape(G, nb, 64)
        out[:, :, 96:160] = m.reshape(G, nb, X8_ROWS, 8).transpose(0, 1, 3, 2).reshape(G, nb, 64)
        qs = b[:, :, :, 16:144].reshape(G, nb, X8_ROWS, 4, 8, 4)                       # [G, nb, r, p, c, i]
        out[:, :, 160:] = qs.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 1024)
    return _repack(w, "Q4_K", _Q4K_BYTES, X8_BLOCK_BYTES, 0, fill, release)


def repack_q8_0_x8(w: np.ndarray, release: bool = False) -> np.ndarray:
    """Q8_0 rows ``w`` (uint8 ``[N, K / 32 * 34]``) -> the interleaved Q8_0 layout, uint8 ``[N, K / 32 *
    34]`` (the same size; new memory): per group of 8 rows and 32-value block, the 8 rows' f16 ``d``
    (16 bytes), then for ``c`` in 0..7 32 bytes, row ``r``'s codes ``4 c .. 4 c + 3`` plus 128 (as
    unsigned bytes, for ``vpdpbusd``) at ``4 r``. ``release``: as ``repack_q4_k_x8``'s.

    Raises:
        ValueError: ``N`` is not a multiple of 8 or ``w`` is not whole Q8_0 rows.
    """
    def fill(b, out):
        G, nb = out.shape[:2]
        qs = b[:, :, :, 2:34].reshape(G, nb, X8_ROWS, 8, 4) ^ np.uint8(0x80)           # [G, nb, r, c, i]: q + 128
        out[:, :, 16:] = qs.transpose(0, 1, 3, 2, 4).reshape(G, nb, 256)
    return _repack(w, "Q8_0", _Q80_BYTES, X8_Q8_0_BLOCK_BYTES, 0, fill, release)


def repack_q4_x8(w: np.ndarray, qtype: int, release: bool = False) -> np.ndarray:
    """Q4_0 or Q4_1 rows ``w`` (uint8 ``[N, K / 32 * 18]`` / ``* 20``) -> their interleaved layout, the
    same size (new memory): per group of 8 rows and 32-value block, the 8 rows' f16 ``d``, Q4_1's 8
    f16 ``m``, then for ``c`` in 0..3 32 bytes, row ``r``'s ``qs[4 c : 4 c + 4]`` at ``4 r`` (low
    nibbles values ``4 c + i``, high nibbles ``16 + 4 c + i``, as GGUF packs them). ``release``: as
    ``repack_q4_k_x8``'s.

    Raises:
        ValueError: ``N`` is not a multiple of 8 or ``w`` is not whole blocks of the type.
    """
    q1 = qtype == Q4_1
    bb, gb, qs0 = (_Q41_BYTES, X8_Q4_1_BLOCK_BYTES, 4) if q1 else (_Q40_BYTES, X8_Q4_0_BLOCK_BYTES, 2)

    def fill(b, out):
        G, nb = out.shape[:2]
        if q1:
            out[:, :, 16:32] = b[:, :, :, 2:4].reshape(G, nb, 16)
        qs = b[:, :, :, qs0:qs0 + 16].reshape(G, nb, X8_ROWS, 4, 4)                  # [G, nb, r, c, i]
        out[:, :, gb - 128:] = qs.transpose(0, 1, 3, 2, 4).reshape(G, nb, 128)
    return _repack(w, "Q4_1" if q1 else "Q4_0", bb, gb, 0, fill, release)


def _q6_k_codes(b: np.ndarray) -> np.ndarray:
    # Q6_K blocks [..., 210] -> their codes 0..63 in value order [..., 256] (value 32 g + l of
    # half h: low 4 bits from ql[64 h + l + 32 (g & 1)], nibble g >> 1; high 2 from qh[32 h + l] >> 2 g)
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(lead + (2, 64))
    qh = b[..., 128:192].reshape(lead + (2, 1, 32))
    lo = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2)
    hi = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return (lo | (hi << 4)).reshape(lead + (256,))


def repack_q6_k_x8(w: np.ndarray, release: bool = False) -> np.ndarray:
    """Q6_K rows ``w`` (uint8 ``[N, K / 256 * 210]``) -> the interleaved Q6_K layout, uint8 ``[N, K /
    256 * 210]`` (the same size; new memory): per group of 8 rows and superblock
    (``X8_Q6_K_BLOCK_BYTES`` = 1680), with ``L`` / ``H`` a row's codes' low 4 / high 2 bits in value order:

      ====== ========= ========================================================================
      bytes  field     meaning
      ====== ========= ========================================================================
      0      d[8]      each row's f16 ``d``
      16     sc[16][8] ``sc[j][r]``: 16-value sub-block ``j``'s int8 scale of row ``r``
      144    codes     48 chunks of 32 bytes, row ``r``'s 4 bytes at ``4 r``: ``ql(p, c)`` for ``p``
                       in 0..3, ``c`` in 0..7, byte ``i``: ``L[64 p + 4 c + i] | L[64 p + 32 + 4 c + i]
                       << 4``; ``qh(h, c)`` for ``h`` in 0..1, byte ``i``: ``H[128 h + 32 g + 4 c + i] <<
                       2 g`` for ``g`` in 0..3, or-ed. In the order the kernel first reads them: for
                       ``h`` in 0, 1: ``ql(2 h, 0..3)``, ``qh(h, 0..3)``, ``ql(2 h, 4..7)``, ``qh(h,
                       4..7)``, ``ql(2 h + 1, 0..7)`` (``_q6k_ql_at``, ``_q6k_qh_at``)
      ====== ========= ========================================================================

    ``release``: as ``repack_q4_k_x8``'s.

    Raises:
        ValueError: ``N`` is not a multiple of 8 or ``w`` is not whole Q6_K rows.
    """
    return _repack(w, "Q6_K", _Q6K_BYTES, X8_Q6_K_BLOCK_BYTES, 208, _fill_q6_k, release)


def _fill_q6_k(b, out):
    G, nb = out.shape[:2]
    out[:, :, 16:144] = b[:, :, :, 192:208].transpose(0, 1, 3, 2).reshape(G, nb, 128)
    codes = _q6_k_codes(b)                                                 # [G, nb, r, 256]
    low = (codes & 15).reshape(G, nb, X8_ROWS, 4, 2, 8, 4)                # [.., r, p, half, c, i]
    ql = (low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)).transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 4, 256)
    high = (codes >> 4).reshape(G, nb, X8_ROWS, 2, 4, 8, 4)               # [.., r, h, g, c, i]
    qh = high[:, :, :, :, 0] | (high[:, :, :, :, 1] << 2) | (high[:, :, :, :, 2] << 4) | (high[:, :, :, :, 3] << 6)
    qh = qh.transpose(0, 1, 3, 4, 2, 5).reshape(G, nb, 2, 256)
    for c in range(8):
        for p in range(4):
            out[:, :, _q6k_ql_at(p, c):_q6k_ql_at(p, c) + 32] = ql[:, :, p, 32 * c:32 * c + 32]
        for h in range(2):
            out[:, :, _q6k_qh_at(h, c):_q6k_qh_at(h, c) + 32] = qh[:, :, h, 32 * c:32 * c + 32]


def _x8_signature(w, s, out):
    # the interleaved intrinsics' (w, woff, s, t0, T, K, out, col): uint8 weights, a float32
    # scratch row, a C-contiguous float32 [T, N] output
    if not (isinstance(w, types.Array) and w.dtype == types.uint8 and isinstance(s, types.Array)
            and s.dtype == types.float32 and isinstance(out, types.Array) and out.dtype == types.float32
            and out.ndim == 2 and out.layout == "C"):
        return None
    return types.void(w, types.int64, s, types.int64, types.int64, types.int64, out, types.int64)


def _x8_args(context, builder, sg, args):
    # (weights i8*, woff, scratch float*, scratch i8*, t0, T, K, output float*, output row length, col)
    wv, woffv, sv, t0v, Tv, Kv, ov, colv = args
    wp = context.make_array(sg.args[0])(context, builder, wv).data
    sf = context.make_array(sg.args[2])(context, builder, sv).data
    oarr = context.make_array(sg.args[6])(context, builder, ov)
    ncols = cgutils.unpack_tuple(builder, oarr.shape, 2)[1]
    return wp, woffv, sf, builder.bitcast(sf, _I8.as_pointer()), t0v, Tv, Kv, oarr.data, ncols, colv


def _token_blocks(builder, t0v, n32, first, nt, xq0):
    # per token t0 + i: the index of its activation block ``first`` (token-major) and the byte
    # offset of that block's codes
    blk = [builder.add(builder.mul(builder.add(t0v, _c64(i)), n32), first) for i in range(nt)]
    return blk, [builder.add(xq0, builder.mul(b, _c64(INT8_BLOCK))) for b in blk]


def _x4(builder, sbytes, at):
    # the 4 activation codes at byte ``at`` of the scratch, broadcast to the 8 rows' lanes (vpbroadcastd)
    return builder.bitcast(_splat(builder, _load(builder, sbytes, at, _I32), _V8I32), _V32I8)


def _fma_into(builder, acc, a, b):
    # acc (an <8 x float> slot) = fma(a, b, acc)
    builder.store(_call(builder, "llvm.fma.v8f32", _V8F, [a, b, builder.load(acc)]), acc)


def _add_block(builder, acc, isum, d, dx):
    # acc += float(isum) * (d * d_x): a block's 8 integer row sums, scaled by the rows' d and the token's d_x
    _fma_into(builder, acc, builder.sitofp(isum, _V8F), builder.fmul(d, _splat(builder, dx, _V8F)))


def _store8(builder, odata, ncols, t0v, colv, i, value):
    # the 8 rows' results of token t0 + i (<8 x float>) at out[t0 + i, col : col + 8]
    off = builder.add(builder.mul(builder.add(t0v, _c64(i)), ncols), colv)
    builder.store(value, builder.bitcast(builder.gep(odata, [off]), value.type.as_pointer()), align=4)


def _x8_intrinsic(name: str, emit):
    """An intrinsic ``(w, woff, s, t0, T, K, out, col)`` (``_x8_signature``) whose code is
    ``emit(builder, *_x8_args(...))``: each interleaved layout's kernel is its ``emit``."""

    def impl(typingctx, w, woff, s, t0, T, K, out, col):
        sig = _x8_signature(w, s, out)
        if sig is None:
            return None

        def codegen(context, builder, sg, args):
            emit(builder, *_x8_args(context, builder, sg, args))
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = name
    return intrinsic(impl)


def _accumulators(builder, n):
    # n <8 x float> accumulators, zero
    return [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(n)]


def _group_block(builder, wp, woffv, index, group_bytes):
    # (the group's block ``index``: an i8 pointer, its 8 rows' f16 d as <8 x float>)
    ob = builder.gep(wp, [builder.add(woffv, builder.mul(index, _c64(group_bytes)))])
    return ob, builder.fpext(_load(builder, ob, _c64(0), ir.VectorType(_HALF, 8)), _V8F)


def _minus_code_sum(builder, sbytes, xb0, blk, isum, shift):
    # isum - (sum of activation block blk's codes << shift), splat over the 8 lanes: a code offset
    # (Q8_0's +128: shift 7; Q4_0's -8 as +8: shift 3) taken off exactly in int32
    halves = _load(builder, sbytes, builder.add(xb0, builder.mul(blk, _c64(4))), ir.VectorType(_I16, 2))
    qsum = builder.add(builder.sext(builder.extract_element(halves, ir.Constant(_I32, 0)), _I32),
                       builder.sext(builder.extract_element(halves, ir.Constant(_I32, 1)), _I32))
    return builder.sub(isum, _splat(builder, builder.shl(qsum, ir.Constant(_I32, shift)), _V8I32))


def _make_x8(nt: int):
    """An intrinsic ``(w, woff, s, t0, T, K, out, col)``: the 8 interleaved rows at byte ``woff`` of
    ``w`` times tokens ``t0 .. t0 + nt - 1`` of the activations in scratch ``s`` (``T`` tokens of
    ``K`` values); stores token ``t``'s 8 results at ``out[t, col : col + 8]``."""

    def emit(builder, wp, woffv, sf, sbytes, t0v, Tv, Kv, odata, ncols, colv):
        n32, xd0, xs0, xq0, _xb0 = _scratch_layout(builder, Tv, Kv)
        v8f = _V8F
        v8b = ir.VectorType(_I8, 8)
        zero_i = ir.Constant(_V8I32, [0] * 8)
        m15 = ir.Constant(_V32I8, [15] * 32)
        acc = _accumulators(builder, nt)
        corr = _accumulators(builder, nt)
        with cgutils.for_range(builder, builder.udiv(n32, _c64(8))) as loop:
            b = loop.index
            ob = builder.gep(wp, [builder.add(woffv, builder.mul(b, _c64(X8_BLOCK_BYTES)))])
            dv = builder.fpext(_load(builder, ob, _c64(0), ir.VectorType(_HALF, 8)), v8f)
            dminv = builder.fpext(_load(builder, ob, _c64(16), ir.VectorType(_HALF, 8)), v8f)
            # token i's first activation block of this superblock
            blk, xb = _token_blocks(builder, t0v, n32, builder.mul(b, _c64(8)), nt, xq0)
            for p in range(4):
                lo_sums, hi_sums = [zero_i] * nt, [zero_i] * nt
                for c in range(8):
                    q = _load(builder, ob, _c64(160 + (8 * p + c) * 32), _V16I16)
                    lo = builder.and_(builder.bitcast(q, _V32I8), m15)
                    hi = builder.and_(builder.bitcast(builder.lshr(q, ir.Constant(_V16I16, [4] * 16)), _V32I8),
                                      m15)
                    for i in range(nt):
                        xl = _x4(builder, sbytes, builder.add(xb[i], _c64(64 * p + 4 * c)))
                        xh = _x4(builder, sbytes, builder.add(xb[i], _c64(64 * p + 32 + 4 * c)))
                        # codes 0..15: AVX2's pair sums |2 * 15 * 127| < 2^15
                        lo_sums[i] = _udot(builder, lo, xl, lo_sums[i])
                        hi_sums[i] = _udot(builder, hi, xh, hi_sums[i])
                for h, sums in ((0, lo_sums), (1, hi_sums)):
                    j = 2 * p + h
                    dsc = builder.fmul(dv, builder.uitofp(_load(builder, ob, _c64(32 + 8 * j), v8b), v8f))
                    dm = builder.fmul(dminv, builder.uitofp(_load(builder, ob, _c64(96 + 8 * j), v8b), v8f))
                    for i in range(nt):
                        dx = _load(builder, sf, builder.add(xd0, builder.add(blk[i], _c64(j))), _FL)
                        sx = _load(builder, sf, builder.add(xs0, builder.add(blk[i], _c64(j))), _FL)
                        _add_block(builder, acc[i], sums[i], dsc, dx)
                        _fma_into(builder, corr[i], dm, _splat(builder, sx, v8f))
        for i in range(nt):
            _store8(builder, odata, ncols, t0v, colv, i, builder.fsub(builder.load(acc[i]), builder.load(corr[i])))

    return _x8_intrinsic(f"_x8_q4_k_{nt}", emit)


def _make_x8_q8_0(nt: int):
    """``_make_x8``'s intrinsic for the interleaved Q8_0 layout: per 32-value block and token, 8
    ``vpdpbusd`` of the codes plus 128 with 4 broadcast activation codes, minus ``128 sum q_x``
    (the activations' two half sums, exact in int32), converted and multiplied-added with ``d_w
    d_x`` for the 8 rows."""

    def emit(builder, wp, woffv, sf, sbytes, t0v, Tv, Kv, odata, ncols, colv):
        n32, xd0, _xs0, xq0, xb0 = _scratch_layout(builder, Tv, Kv)
        zero_i = ir.Constant(_V8I32, [0] * 8)
        vnni = ISA == "avx512vnni"
        acc = _accumulators(builder, nt)
        with cgutils.for_range(builder, n32) as loop:
            j = loop.index
            ob, dv = _group_block(builder, wp, woffv, j, X8_Q8_0_BLOCK_BYTES)
            blk, xb = _token_blocks(builder, t0v, n32, j, nt, xq0)
            sums = [zero_i] * nt
            for c in range(8):
                codes = _load(builder, ob, _c64(16 + 32 * c), _V32I8)
                if not vnni:
                    # AVX2: vpmaddubsw saturates its int16 pair sums, and 2 * 255 * 127 > 2^15 - 1:
                    # the signed codes instead, |w| times x with w's sign (vpsignb), as the row
                    # kernel and llama.cpp's mul_sum_i8_pairs (2 * 128 * 127 < 2^15)
                    signed = builder.xor(codes, ir.Constant(_V32I8, [-128] * 32))
                    codes = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [signed, signed])
                for i in range(nt):
                    xv = _x4(builder, sbytes, builder.add(xb[i], _c64(4 * c)))
                    if not vnni:
                        xv = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [xv, signed])
                    sums[i] = _udot(builder, codes, xv, sums[i])
            for i in range(nt):
                isum = sums[i]
                if vnni:
                    # the codes' +128: minus 128 times the block's activation codes' sum (its halves)
                    isum = _minus_code_sum(builder, sbytes, xb0, blk[i], isum, 7)
                _add_block(builder, acc[i], isum, dv, _load(builder, sf, builder.add(xd0, blk[i]), _FL))
        for i in range(nt):
            _store8(builder, odata, ncols, t0v, colv, i, builder.load(acc[i]))

    return _x8_intrinsic(f"_x8_q8_0_{nt}", emit)


def _make_x8_q4(nt: int, q1: bool):
    """``_make_x8``'s intrinsic for the interleaved Q4_0 / Q4_1 layouts (``repack_q4_x8``): per
    32-value block and token, 8 ``vpdpbusd`` of codes 0..15 with 4 broadcast activation codes (AVX2
    pair sums at most ``2 * 15 * 127``); Q4_0's ``-8`` as ``- 8 sum q_x`` in int32 (exact), then
    one conversion and one multiply-add with ``d_w d_x``; Q4_1's ``m`` as ``m (d_x sum q_x)``, one
    multiply-add into a second accumulator, added at the end."""

    def emit(builder, wp, woffv, sf, sbytes, t0v, Tv, Kv, odata, ncols, colv):
        n32, xd0, xs0, xq0, xb0 = _scratch_layout(builder, Tv, Kv)
        v8f = _V8F
        zero_i = ir.Constant(_V8I32, [0] * 8)
        m15 = ir.Constant(_V32I8, [15] * 32)
        gb, q0 = (X8_Q4_1_BLOCK_BYTES, 32) if q1 else (X8_Q4_0_BLOCK_BYTES, 16)
        acc = _accumulators(builder, nt)
        corr = _accumulators(builder, nt) if q1 else []
        with cgutils.for_range(builder, n32) as loop:
            j = loop.index
            ob, dv = _group_block(builder, wp, woffv, j, gb)
            blk, xb = _token_blocks(builder, t0v, n32, j, nt, xq0)
            sums = [zero_i] * nt
            for c in range(4):
                q = _load(builder, ob, _c64(q0 + 32 * c), _V16I16)
                lo = builder.and_(builder.bitcast(q, _V32I8), m15)
                hi = builder.and_(builder.bitcast(builder.lshr(q, ir.Constant(_V16I16, [4] * 16)), _V32I8), m15)
                for i in range(nt):
                    for codes, at in ((lo, 4 * c), (hi, 16 + 4 * c)):
                        sums[i] = _udot(builder, codes, _x4(builder, sbytes, builder.add(xb[i], _c64(at))),
                                        sums[i])
            for i in range(nt):
                isum = sums[i]
                if not q1:   # the codes' -8: minus 8 times the block's activation codes' sum (its halves)
                    isum = _minus_code_sum(builder, sbytes, xb0, blk[i], isum, 3)
                _add_block(builder, acc[i], isum, dv, _load(builder, sf, builder.add(xd0, blk[i]), _FL))
                if q1:
                    mv = builder.fpext(_load(builder, ob, _c64(16), ir.VectorType(_HALF, 8)), v8f)
                    sx = _load(builder, sf, builder.add(xs0, blk[i]), _FL)
                    _fma_into(builder, corr[i], mv, _splat(builder, sx, v8f))
        for i in range(nt):
            total = builder.load(acc[i])
            if q1:
                total = builder.fadd(total, builder.load(corr[i]))
            _store8(builder, odata, ncols, t0v, colv, i, total)

    return _x8_intrinsic(f"_x8_q4_{1 if q1 else 0}_{nt}", emit)


def _make_x8_q6_k(nt: int):
    """``_make_x8``'s intrinsic for the interleaved Q6_K layout (``repack_q6_k_x8``): per 64 values
    ``p`` and token, the 8 rows' integer sums of each 16-value sub-block (codes 0..63 by
    ``vpdpbusd``; AVX2 ``vpmaddubsw`` pair sums at most ``2 * 63 * 127 < 2^15``), then per 32-value
    activation block ``sc_a (s_a - 32 h_a) + sc_b (s_b - 32 h_b)`` in int32 (``h`` the
    activations' half sums: the codes' ``-32``; exact, at most ``2 * 16 * 32 * 127 * 128 < 2^24``,
    so its conversion is exact too), converted and multiplied-added with ``d_w d_x`` for the 8 rows:
    the row kernel's terms (``quant_int8``'s Q6_K), summed in another order."""

    def emit(builder, wp, woffv, sf, sbytes, t0v, Tv, Kv, odata, ncols, colv):
        n32, xd0, _xs0, xq0, xb0 = _scratch_layout(builder, Tv, Kv)
        v8f = _V8F
        v8b = ir.VectorType(_I8, 8)
        zero_i = ir.Constant(_V8I32, [0] * 8)

        def c8(v):
            return ir.Constant(_V32I8, [v] * 32)
        acc = _accumulators(builder, nt)
        with cgutils.for_range(builder, builder.udiv(n32, _c64(8))) as loop:
            b = loop.index
            ob = builder.gep(wp, [builder.add(woffv, builder.mul(b, _c64(X8_Q6_K_BLOCK_BYTES)))])
            dv = builder.fpext(_load(builder, ob, _c64(0), ir.VectorType(_HALF, 8)), v8f)
            blk, xb = _token_blocks(builder, t0v, n32, builder.mul(b, _c64(8)), nt, xq0)
            for p in range(4):
                for h in range(2):             # the low nibbles (block 2 p), the high ones (2 p + 1)
                    j = 2 * p + h
                    shift = 4 * (p % 2) + 2 * h    # where the values' two high bits sit in qh's bytes
                    isum = [zero_i] * nt
                    for half in range(2):      # 16-value sub-blocks 2 j, 2 j + 1
                        sums = [zero_i] * nt
                        for c in range(4 * half, 4 * half + 4):
                            q = _load(builder, ob, _c64(_q6k_ql_at(p, c)), _V32I8)
                            q = builder.and_(q if h == 0 else builder.lshr(q, c8(4)), c8(15))
                            qh = _load(builder, ob, _c64(_q6k_qh_at(p // 2, c)), _V32I8)
                            top = builder.shl(qh, c8(4 - shift)) if shift <= 4 else builder.lshr(qh, c8(shift - 4))
                            codes = builder.or_(q, builder.and_(top, c8(0x30)))
                            for i in range(nt):
                                x4 = _x4(builder, sbytes, builder.add(xb[i], _c64(32 * j + 4 * c)))
                                sums[i] = _udot(builder, codes, x4, sums[i])
                        sc = builder.sext(_load(builder, ob, _c64(16 + 8 * (2 * j + half)), v8b), _V8I32)
                        for i in range(nt):
                            # the codes' -32: the activations' sum over this 16-value half, times 32
                            hoff = builder.add(xb0, builder.add(builder.mul(builder.add(blk[i], _c64(j)), _c64(4)),
                                                                _c64(2 * half)))
                            hs = builder.sext(_load(builder, sbytes, hoff, _I16), _I32)
                            off = _splat(builder, builder.shl(hs, ir.Constant(_I32, 5)), _V8I32)
                            isum[i] = builder.add(isum[i], builder.mul(sc, builder.sub(sums[i], off)))
                    for i in range(nt):
                        dx = _load(builder, sf, builder.add(xd0, builder.add(blk[i], _c64(j))), _FL)
                        _add_block(builder, acc[i], isum[i], dv, dx)
        for i in range(nt):
            _store8(builder, odata, ncols, t0v, colv, i, builder.load(acc[i]))

    return _x8_intrinsic(f"_x8_q6_k_{nt}", emit)


_NT = 4
_x8_q4_k_1, _x8_q4_k_4 = _make_x8(1), _make_x8(_NT)
_x8_q8_0_1, _x8_q8_0_4 = _make_x8_q8_0(1), _make_x8_q8_0(_NT)
_x8_q6_k_1, _x8_q6_k_4 = _make_x8_q6_k(1), _make_x8_q6_k(_NT)
_x8_q4_0_1, _x8_q4_0_4 = _make_x8_q4(1, False), _make_x8_q4(_NT, False)
_x8_q4_1_1, _x8_q4_1_4 = _make_x8_q4(1, True), _make_x8_q4(_NT, True)


@njit(cache=True)
def x8_rows(x, w, qtype, out, col0, s, r0, r1):
    """``out[:, col0 + r] ~= x @ dequantize(row r).T`` for ``r0 <= r < r1`` (multiples of 8) of the
    interleaved weight ``w`` of GGML type ``qtype`` (``repack_*``'s: Q4_K's ``[N, x8_row_bytes(K)]``,
    the others their type's row size), through int8 activations quantized into the
    scratch row ``s`` as ``quant_int8.int8_rows`` does (once per task and product: the same key)."""
    T, K = x.shape
    quantize_once(x, w, s)
    rb = w.shape[1]
    for r in range(r0, r1, 8):
        woff = r * rb
        t = 0
        while T - t >= _NT:
            if qtype == Q4_K:
                _x8_q4_k_4(w, woff, s, t, T, K, out, col0 + r)
            elif qtype == Q6_K:
                _x8_q6_k_4(w, woff, s, t, T, K, out, col0 + r)
            elif qtype == Q4_1:
                _x8_q4_1_4(w, woff, s, t, T, K, out, col0 + r)
            elif qtype == Q4_0:
                _x8_q4_0_4(w, woff, s, t, T, K, out, col0 + r)
            else:
                _x8_q8_0_4(w, woff, s, t, T, K, out, col0 + r)
            t += _NT
        while t < T:
            if qtype == Q4_K:
                _x8_q4_k_1(w, woff, s, t, T, K, out, col0 + r)
            elif qtype == Q6_K:
                _x8_q6_k_1(w, woff, s, t, T, K, out, col0 + r)
            elif qtype == Q4_1:
                _x8_q4_1_1(w, woff, s, t, T, K, out, col0 + r)
            elif qtype == Q4_0:
                _x8_q4_0_1(w, woff, s, t, T, K, out, col0 + r)
            else:
                _x8_q8_0_1(w, woff, s, t, T, K, out, col0 + r)
            t += 1


@njit(cache=True)
def x8_decode_rows(w, qtype, ids, out):
    """``out[t] = dequantize(row ids[t])`` of an interleaved weight ``w`` (a ``repack_*``'s, GGML type
    ``qtype``): the embedding lookup of a table the kernels read interleaved (one tied to
    ``lm_head``). The reference's float32 operations in
    its order (no fast-math): bit-identical with ``quant_reference.dequantize`` of the GGUF row.
    ``ids`` in range (the caller checks); ``out`` float32 ``[T, K]``."""
    K = out.shape[1]
    flat = w.reshape(-1)
    rb = w.shape[1]
    for t in range(ids.shape[0]):
        r = ids[t]
        lane = r % X8_ROWS
        g0 = (r - lane) * rb          # group r // 8 starts at row 8 (r // 8)'s slot
        if qtype == Q8_0:
            for j in range(K // 32):
                o = g0 + j * X8_Q8_0_BLOCK_BYTES
                d = load_f16(flat, o + 2 * lane)
                for c in range(8):
                    for i in range(4):
                        q = np.int32(flat[o + 16 + 32 * c + 4 * lane + i]) - 128
                        out[t, 32 * j + 4 * c + i] = d * np.float32(q)
        elif qtype == Q4_0 or qtype == Q4_1:
            gb = X8_Q4_1_BLOCK_BYTES if qtype == Q4_1 else X8_Q4_0_BLOCK_BYTES
            for j in range(K // 32):
                o = g0 + j * gb
                d = load_f16(flat, o + 2 * lane)
                m = load_f16(flat, o + 16 + 2 * lane) if qtype == Q4_1 else np.float32(0.0)
                for c in range(4):
                    for i in range(4):
                        byte = np.int32(flat[o + gb - 128 + 32 * c + 4 * lane + i])
                        for h in range(2):
                            q = (byte >> 4) if h else (byte & 15)
                            k = 32 * j + 16 * h + 4 * c + i
                            if qtype == Q4_1:
                                out[t, k] = d * np.float32(q) + m
                            else:
                                out[t, k] = d * np.float32(q - 8)
        elif qtype == Q4_K:
            for b in range(K // 256):
                o = g0 + b * X8_BLOCK_BYTES
                d = load_f16(flat, o + 2 * lane)
                dmin = load_f16(flat, o + 16 + 2 * lane)
                for p in range(4):
                    for h in range(2):
                        j = 2 * p + h
                        d1 = d * np.float32(flat[o + 32 + 8 * j + lane])
                        m1 = dmin * np.float32(flat[o + 96 + 8 * j + lane])
                        for c in range(8):
                            for i in range(4):
                                byte = np.int32(flat[o + 160 + (8 * p + c) * 32 + 4 * lane + i])
                                q = (byte >> 4) if h else (byte & 15)
                                out[t, 256 * b + 64 * p + 32 * h + 4 * c + i] = d1 * np.float32(q) - m1
        else:   # Q6_K
            for b in range(K // 256):
                o = g0 + b * X8_Q6_K_BLOCK_BYTES
                d = load_f16(flat, o + 2 * lane)
                for p in range(4):
                    for h in range(2):
                        shift = 4 * (p % 2) + 2 * h
                        for c in range(8):
                            sub = (64 * p + 32 * h + 4 * c) // 16
                            d1 = d * np.float32(np.int8(flat[o + 16 + 8 * sub + lane]))
                            for i in range(4):
                                lo = np.int32(flat[o + _q6k_ql_at(p, c) + 4 * lane + i])
                                lo = (lo >> 4) if h else (lo & 15)
                                hi = (np.int32(flat[o + _q6k_qh_at(p // 2, c) + 4 * lane + i]) >> shift) & 3
                                q = (lo | (hi << 4)) - 32
                                out[t, 256 * b + 64 * p + 32 * h + 4 * c + i] = d1 * np.float32(q)

# ----------------------------------------------------------------------------------------------
# compiled ahead (compile_jobs.py; runtime/worker/precompile.py through the table)
# ----------------------------------------------------------------------------------------------

PRECOMPILE = (
    NumbaJob(x8_decode_rows, "U2 i64 I1 F2", "rest", 2, "embedding rows from an interleaved table (tied to lm_head)",
             ("quantized-int8",)),
)
