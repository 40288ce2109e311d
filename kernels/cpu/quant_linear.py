"""Matrix products and the embedding lookup straight from GGUF-quantized weights, on the CPU.

``quant_linear``: ``out [T, N] = x [T, K] @ W [N, K]^T`` with ``W`` stored as GGUF blocks, ``N`` rows
of ``row_bytes(type, K)`` bytes (``kernels/quant_reference.py`` is the specification of every type:
F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).

Two ways of computing, chosen per weight (``quant_kernel_type``) and per product size:

* **float32 activations** (``--activation-quantization none``, and the embedded default model's
  default): dequantize in registers. A task takes a block of
  ``QUANT_BLOCK_ROWS`` weight rows; 4 rows at a time it decodes each row's blocks into a float32
  scratch row of ``K`` values (per task, ``[4, K]``, in L1/L2: 32 KB at K = 2048), with exactly the
  float32 operations of the reference's ``dequantize`` (this function is compiled without
  fast-math, so its values are bit-identical to the reference's and llama.cpp's), then takes the 4
  rows' dot products with the tokens, 2 tokens x 4 rows per pass over the scratch rows (8 sums:
  each loaded weight value feeds 2 of them, each token value 4, as the float32 kernel's register
  blocks for AVX2; fast-math: LLVM vectorises each sum into 8- or 16-lane partial sums, float32
  accumulation). Up to ``FUSED_MAX_TOKENS`` (8) tokens of Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K
  (decode steps): decoded and multiplied in one pass instead, in registers, 4 tokens per pass
  over a row (``quant_fused.py``: the same exact weight values, no scratch row). The results are
  float32 dot products with the exactly dequantized weights: what the default model's golden
  outputs were computed from, so this stays that model's default.
* **int8 activations** (``quant_kernel_type(q, "int8")``, ``quant_linear(...,
  activations="int8")``; ``kernels/cpu/quant_int8.py``): the tokens quantized per 32 values to
  8 bits (once per task and product, kept in the task's scratch), integer dot products of the
  weight codes with them (``vpdpbusd`` with AVX512-VNNI, ``vpmaddubsw`` + ``vpmaddwd`` with AVX2),
  converted and multiplied-added by the scales once per 8 blocks (256 values), as llama.cpp's
  ``ggml_vec_dot_*_q8_*``. For Q8_0, Q4_0,
  Q4_1, Q4_K, Q5_K and Q6_K; the results differ from the float32 path by the activations' rounding
  (bounds in ``tests/kernels/test_quant_int8.py``), so the default model keeps float32; every other
  quantized GGUF file takes this path by default (``--activation-quantization auto``,
  ``model.loader.resolve_activation_quantization``). Q4_K, Q6_K, Q8_0, Q4_0 and Q4_1 weights with
  int8 activations (the layers' when the stacks are built, lm_head's and the embedding table's in
  the CPU table's ``prepare_weight``) are interleaved by 8 rows (``kernel_layout``, kernel types
  ``*_X8``, ``quant_x8.py``): no horizontal sums, and it takes every token count.

Which way: with int8 activations asked for, the integer path up to ``INT8_MAX_TOKENS`` tokens (16
with AVX512-VNNI, 8 with AVX2; ``INT8_MAX_TOKENS_Q6_K`` = 4 for Q6_K), and the float32 path above
that (prefill chunks: the decoded tiles and BLAS's packed float32 sgemm, exact). Where Numba
compiles for neither AVX2 nor AVX512-VNNI (``quant_int8.ISA`` is ``None``), every product keeps
float32 activations.

**More tokens** (prefill chunks, above ``QUANT_GEMV_MAX_TOKENS`` = 32): a task decodes a tile of
``QUANT_SCRATCH_ROWS`` weight rows into its scratch once and multiplies every token against it
with one single-threaded ``sgemm`` (BLAS's packed kernels; the decoding is then a ``1 / T`` share
of the work), as the float32 path's sgemm tiles (``linear.py``).

Threads: the project's policy (``threads.py``): one Numba ``prange`` region with a task per
thread, tasks taking row blocks from a shared atomic counter (``fetch_add``); weights under
``_PARALLEL_MIN_WEIGHTS`` values run on the calling thread; the scratch is allocated by the
caller (``quant_scratch``: per task a key, the quantized activations of the integer path and
``QUANT_SCRATCH_ROWS`` decoded rows), none inside the region.

``quant_embedding``: the rows of a quantized embedding table for a list of token ids, bit-identical
to ``dequantize`` of those rows. A weight row is decoded by ``quant_decode.decode_row``.

Sources: llama.cpp ``ggml-quants.c`` ``dequantize_row_*`` (the value of each quant) and
``ggml-cpu`` ``ggml_vec_dot_*`` (the decode-sized products); the GGUF specification
(github.com/ggml-org/ggml/blob/master/docs/gguf.md, tensor data laid out in rows of blocks).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..quant_reference import (BF16, F16, F32, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, QUANT_TYPES, quant_type,
                               row_bytes)
from . import quant_int8
from .compile_jobs import QUANTIZED, NumbaJob
from .quant_decode import decode_row
from .quant_fused import FUSED_MAX_TOKENS, fused_rows
from .quant_int8 import INT8_TYPES, int8_rows, int8_scratch_size
from .quant_x8 import (X8_ROWS, repack_q4_k_x8, repack_q4_x8, repack_q6_k_x8, repack_q8_0_x8, x8_decode_rows,
                       x8_row_bytes, x8_rows)
from .threads import NO_TRANS, ROW_MAJOR, TRANS, fetch_add, num_threads, ptr, region_guard, sgemm

__all__ = ["quant_linear", "quant_linear_into", "quant_linear_tasks", "quant_embedding", "decode_row", "quant_rows",
           "quant_item_rows", "quant_scratch", "quant_task_rows", "quant_kernel_type", "int8_max_tokens", "ACTIVATIONS",
           "KERNEL_TYPES", "QUANT_BLOCK_ROWS", "QUANT_SCRATCH_ROWS", "QUANT_GEMV_MAX_TOKENS", "quant_task_rows_f32",
           "Q4_K_X8", "Q8_0_X8", "Q6_K_X8", "Q4_0_X8", "Q4_1_X8", "X8_TYPES", "kernel_layout", "interleaved_embedding",
           "kernel_row_bytes"]

_F32 = np.float32
QUANT_BLOCK_ROWS = 16          # weight rows per work item of a decode-sized product, at least
_ITEM_WEIGHTS = 1 << 15        # and about this many weights per item (quant_item_rows)
_ITEM_WEIGHTS_X8 = 1 << 21     # an interleaved weight's items (quant_x8): longer streams
_X8_ITEMS_PER_TASK = 2         # but no longer than a product's rows split this many per task (quant_item_rows)
QUANT_GEMV_MAX_TOKENS = 32     # up to this many tokens decode-and-dot (_rows), more: decoded tiles + sgemm
QUANT_SCRATCH_ROWS = 64        # weight rows per sgemm tile (and rows of each task's scratch)
_PARALLEL_MIN_WEIGHTS = 1 << 16  # smaller weights: the calling thread (as linear.py)

INT8_ACTIVATIONS = 256        # added to a type id: that type's products take the integer path (quant_kernel_type)
INT8_MAX_TOKENS = 16 if quant_int8.ISA == "avx512vnni" else 8   # more tokens: the float32 path even then
INT8_MAX_TOKENS_Q6_K = 4      # Q6_K's integer products: up to this many tokens (see the module docstring)
Q4_K_X8 = 2 * INT8_ACTIVATIONS + Q4_K   # kernel type id: Q4_K rows interleaved by 8, int8 activations (quant_x8)
Q8_0_X8 = 2 * INT8_ACTIVATIONS + Q8_0   # the same for Q8_0
Q6_K_X8 = 2 * INT8_ACTIVATIONS + Q6_K   # the same for Q6_K
Q4_0_X8 = 2 * INT8_ACTIVATIONS + Q4_0   # the same for Q4_0
Q4_1_X8 = 2 * INT8_ACTIVATIONS + Q4_1   # the same for Q4_1
X8_TYPES = (Q4_K, Q6_K, Q8_0, Q4_0, Q4_1)   # the types with an interleaved layout (kernel_layout)

_FUSED = quant_int8.ISA is not None   # quant_fused's decode-and-dot (FUSED_MAX_TOKENS; needs AVX2)

ACTIVATIONS = ("float32", "int8")
"""The activation types ``quant_kernel_type`` accepts: ``"float32"`` (the default: dequantize in
registers, float32 products) or ``"int8"`` (activations quantized per 32 values, integer dot
products, ``quant_int8.py``)."""

KERNEL_TYPES = (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
"""GGML type ids these kernels read (every type of ``quant_reference.QUANT_TYPES``)."""


@njit(cache=True, fastmath=True)
def _dot2x4(x, t, buf, out, r):
    # tokens t, t + 1 against the decoded rows buf[0..3] = weight rows r .. r + 3: each loaded
    # weight value feeds 2 sums, each token value 4 (8 vector accumulators: fits AVX2's registers)
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = _F32(0.0)
    for k in range(x.shape[1]):
        x0 = x[t, k]
        x1 = x[t + 1, k]
        wa, wb, wc, wd = buf[0, k], buf[1, k], buf[2, k], buf[3, k]
        a0 += x0 * wa
        a1 += x1 * wa
        b0 += x0 * wb
        b1 += x1 * wb
        c0 += x0 * wc
        c1 += x1 * wc
        d0 += x0 * wd
        d1 += x1 * wd
    out[t, r], out[t + 1, r] = a0, a1
    out[t, r + 1], out[t + 1, r + 1] = b0, b1
    out[t, r + 2], out[t + 1, r + 2] = c0, c1
    out[t, r + 3], out[t + 1, r + 3] = d0, d1


@njit(cache=True, fastmath=True)
def _dot1x4(x, t, buf, out, r):
    a = b = c = d = _F32(0.0)
    for k in range(x.shape[1]):
        v = x[t, k]
        a += v * buf[0, k]
        b += v * buf[1, k]
        c += v * buf[2, k]
        d += v * buf[3, k]
    out[t, r], out[t, r + 1], out[t, r + 2], out[t, r + 3] = a, b, c, d


@njit(cache=True, fastmath=True)
def _dot1(x, t, row, out, r):
    a = _F32(0.0)
    for k in range(x.shape[1]):
        a += x[t, k] * row[k]
    out[t, r] = a


@njit(cache=True)
def _rows(x, w, qtype, out, col0, buf, r0, r1):
    # out[:, col0 + r0:col0 + r1] = x @ dequantize(w[r0:r1]).T: 4 weight rows decoded into buf [4, K]
    # at a time, then their products with the tokens 2 at a time (one at the end), as the float32
    # kernel's register blocks; the last rows one by one
    T = x.shape[0]
    r = r0
    while r1 - r >= 4:
        for i in range(4):
            decode_row(w[r + i], qtype, buf[i])
        t = 0
        while T - t >= 2:
            _dot2x4(x, t, buf, out, col0 + r)
            t += 2
        if t < T:
            _dot1x4(x, t, buf, out, col0 + r)
        r += 4
    while r < r1:
        decode_row(w[r], qtype, buf[0])
        for t in range(T):
            _dot1(x, t, buf[0], out, col0 + r)
        r += 1


@njit(cache=True)
def _tile(x, w, qtype, out, col0, buf, r0, r1):
    # the same product for many tokens (prefill): the rows decoded once into buf [>= r1 - r0, K],
    # then one single-threaded sgemm of every token against them (BLAS's packed tiles; the
    # decoding is then a 1 / T share of the work)
    T, K = x.shape
    n = r1 - r0
    for i in range(n):
        decode_row(w[r0 + i], qtype, buf[i])
    sgemm(ROW_MAJOR, NO_TRANS, TRANS, T, n, K, _F32(1.0), ptr(x, 0), K, ptr(buf, 0), K, _F32(0.0),
          ptr(out, col0 + r0), out.shape[1])


@njit(cache=True)
def quant_rows(x, w, qtype, out, col0, buf, r0, r1):
    """``out[:, col0 + r] = x @ dequantize(w[r])`` for the weight rows ``r0 <= r < r1``, on the calling
    thread: C-contiguous float32 ``x [T, K]``, uint8 ``w [N, row_bytes]``, float32 ``out [T, >= col0
    + N]``, float32 scratch ``buf [QUANT_SCRATCH_ROWS, K]`` (``r1 - r0 <= QUANT_SCRATCH_ROWS``).
    Up to ``QUANT_GEMV_MAX_TOKENS`` tokens the decode-and-dot kernel (``_rows``), more: decoded rows
    and sgemm (``_tile``). ``qtype`` may be ``quant_kernel_type``'s int8 id: computed here with float32
    activations all the same (the integer path needs ``quant_task_rows``'s scratch)."""
    if qtype >= INT8_ACTIVATIONS:
        qtype -= INT8_ACTIVATIONS
    if x.shape[0] <= QUANT_GEMV_MAX_TOKENS:
        _rows(x, w, qtype, out, col0, buf, r0, r1)
    else:
        _tile(x, w, qtype, out, col0, buf, r0, r1)


@njit(cache=True)
def quant_item_rows(T, K, N, interleaved, tasks):
    """Weight rows per work item of a product of ``T`` tokens and ``N`` rows of ``K`` values, shared
    by ``tasks`` tasks: for decode-sized steps about ``_ITEM_WEIGHTS`` weights (``QUANT_BLOCK_ROWS``
    to ``QUANT_SCRATCH_ROWS`` rows, a multiple of 8, so that each item's claim and call stay a
    small share of it), ``QUANT_SCRATCH_ROWS`` for the sgemm tiles (a larger tile amortises the
    call and its packing of ``x``).

    An ``interleaved`` weight's (``kernel_layout``'s ``*_X8`` kinds) decode-sized items are about
    ``_ITEM_WEIGHTS_X8`` weights (whole groups of ``X8_ROWS`` rows; ``x8_rows`` needs no scratch
    rows), but no longer than the product's rows split ``_X8_ITEMS_PER_TASK`` per task (rounded up
    to groups of 8: about that many items per task), so that the tasks still share every product.
    A decode step's products do nothing but stream their weights, and each item is one stream that
    the hardware prefetchers must pick up again (the tasks' items alternate in memory), so long
    items are what counts, as llama.cpp's repacked products take 4 chunks per thread."""
    if T > QUANT_GEMV_MAX_TOKENS:
        return QUANT_SCRATCH_ROWS
    if interleaved:
        rows = _ITEM_WEIGHTS_X8 // max(K, 1)
        share = (N + _X8_ITEMS_PER_TASK * tasks - 1) // (_X8_ITEMS_PER_TASK * max(tasks, 1))
        return max(X8_ROWS, min(rows, share + X8_ROWS - 1) // X8_ROWS * X8_ROWS)
    return min(QUANT_SCRATCH_ROWS, max(QUANT_BLOCK_ROWS, _ITEM_WEIGHTS // max(K, 1) // X8_ROWS * X8_ROWS))


@njit(cache=True)
def quant_scratch(n_tasks, T, K):
    """Scratch of ``quant_task_rows`` for ``n_tasks`` tasks, products of at most ``T`` tokens and at
    most ``K`` values per weight row (allocated once per step, before the parallel region): float32
    ``[n_tasks, S]``, each task's row the integer path's key and quantized activations
    (``quant_int8``), then the float32 path's ``QUANT_SCRATCH_ROWS`` decoded rows at its end. The
    keys are cleared here: a fresh scratch never takes another step's activations for this one's."""
    s = np.empty((n_tasks, _scratch_size(T, K)), _F32)
    s[:, :8] = 0
    return s


@njit(cache=True, inline="always")
def _scratch_size(T, K):
    return (int8_scratch_size(T, K) + 15) // 16 * 16 + QUANT_SCRATCH_ROWS * K


@njit(cache=True)
def quant_task_rows(x, w, qtype, out, col0, scratch, task, r0, r1):
    """``out[:, col0 + r] = x @ dequantize(w[r]).T`` for the weight rows ``r0 <= r < r1`` on task
    ``task``'s row of ``scratch`` (``quant_scratch``): the entry point of a fused region's work item
    (``kernels/cpu/forward.py``). ``qtype``: a GGML type id, or ``quant_kernel_type``'s id of the
    integer path (which quantizes ``x`` on the task's first item of this product and reuses it for
    its later items: ``x`` must not change while items of one product run, and within one
    scratch's life a pair of ``x`` buffer and weight names one product)."""
    T, K = x.shape
    s = scratch[task]
    if qtype >= 2 * INT8_ACTIVATIONS:   # interleaved rows (quant_x8): every token count
        x8_rows(x, w, qtype - 2 * INT8_ACTIVATIONS, out, col0, s, r0, r1)
        return
    if qtype >= INT8_ACTIVATIONS:
        if T <= (INT8_MAX_TOKENS_Q6_K if qtype == Q6_K + INT8_ACTIVATIONS else INT8_MAX_TOKENS):
            int8_rows(x, w, qtype - INT8_ACTIVATIONS, out, col0, s, r0, r1)
            return
        qtype -= INT8_ACTIVATIONS
    quant_task_rows_f32(x, w, qtype, out, col0, scratch, task, r0, r1)


@njit(cache=True)
def quant_task_rows_f32(x, w, qtype, out, col0, scratch, task, r0, r1):
    """``quant_task_rows`` for a GGML type id (float32 activations): its call tree holds none of the
    integer kernels, so a caller whose weights never take int8 activations compiles none of them
    (``kernels/cpu/forward.py``)."""
    T, K = x.shape
    s = scratch[task]
    if _FUSED and T <= FUSED_MAX_TOKENS and (qtype == Q4_1 or qtype == Q8_0 or qtype == Q4_0 or qtype == Q4_K
                                             or qtype == Q5_K or qtype == Q6_K):
        fused_rows(x, w, qtype, out, col0, s, r0, r1)
        return
    n = s.shape[0]
    buf = s[n - QUANT_SCRATCH_ROWS * K:].reshape(QUANT_SCRATCH_ROWS, K)
    quant_rows(x, w, qtype, out, col0, buf, r0, r1)


def int8_max_tokens(qtype) -> int:
    """The most tokens a product of a ``qtype`` weight takes through the integer path when asked to
    (``quant_kernel_type(qtype, "int8")``); larger products, and 0 here (a type or CPU without
    integer products), keep float32 activations."""
    q = quant_type(qtype)
    if q.id not in INT8_TYPES or quant_int8.ISA is None:
        return 0
    return INT8_MAX_TOKENS_Q6_K if q.id == Q6_K else INT8_MAX_TOKENS


def quant_kernel_type(qtype, activations: str = "float32") -> int:
    """The type id the kernels take for a weight of type ``qtype`` computed with ``activations``
    (``ACTIVATIONS``): the GGML id for ``"float32"``; for ``"int8"`` the id plus
    ``INT8_ACTIVATIONS`` where the type has integer dot products (``quant_int8.INT8_TYPES``) and
    Numba compiles for AVX2 or AVX512-VNNI (``quant_int8.ISA``), else the GGML id (float32
    activations: the other types, or a CPU without them).

    Raises:
        UnsupportedQuantType: ``qtype`` is not a supported type.
        ValueError: ``activations`` is not one of ``ACTIVATIONS``.
    """
    q = quant_type(qtype)
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if activations == "int8" and q.id in INT8_TYPES and quant_int8.ISA is not None:
        return q.id + INT8_ACTIVATIONS
    return q.id


@njit(parallel=True, cache=True)
def _quant_linear_parallel(x, w, qtype, out, scratch, n_tasks, counter):
    N = w.shape[0]
    rows = quant_item_rows(x.shape[0], x.shape[1], N, qtype >= 2 * INT8_ACTIVATIONS, n_tasks)
    n_items = (N + rows - 1) // rows
    for task in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= n_items:
                break
            quant_task_rows(x, w, qtype, out, 0, scratch, task, i * rows, min(N, (i + 1) * rows))


@njit(cache=True, nogil=True)
def quant_linear_into(x, w, qtype, out, scratch, tasks):
    """``out[:] = x @ dequantize(w, qtype).T`` from compiled code: C-contiguous float32 ``x [T, K]``,
    uint8 ``w [N, row_bytes]`` (rows of GGUF blocks of GGML type ``qtype``, or ``quant_kernel_type``'s
    id), float32 ``out [T, N]``, ``scratch`` from ``quant_scratch(tasks, T, K)`` (fresh, or its keys
    cleared); ``tasks`` 1 (the calling thread) or the region's threads (``quant_linear_tasks``).
    Shapes are not checked here (``quant_linear`` checks them)."""
    if x.shape[0] == 0:
        return
    if tasks > 1:
        _quant_linear_parallel(x, w, qtype, out, scratch, tasks, np.zeros(1, np.int64))
    else:
        rows = quant_item_rows(x.shape[0], x.shape[1], w.shape[0], qtype >= 2 * INT8_ACTIVATIONS, 1)
        for r in range(0, w.shape[0], rows):
            quant_task_rows(x, w, qtype, out, 0, scratch, 0, r, min(w.shape[0], r + rows))


def kernel_layout(data: np.ndarray, kernel_type: int, release: bool = False) -> tuple[np.ndarray, int]:
    """The weight rows ``data`` (uint8 ``[N, row_bytes]``, GGUF blocks) and kernel type id
    ``kernel_type`` (``quant_kernel_type``'s) as the products take them: ``X8_TYPES`` with int8
    activations and ``N % 8 == 0`` interleaved by 8 (``quant_x8.repack_*``: new memory, ids ``*_X8``
    = the type's id plus ``2 * INT8_ACTIVATIONS``), every other weight as it is. ``release``: where
    it is copied, hand ``data``'s pages back if it is a read-only mapped file (the caller reads only
    the copy; ``memory.release_mapped_pages``), as the copy is made."""
    if data.shape[0] % X8_ROWS == 0:
        t = kernel_type - INT8_ACTIVATIONS
        if t in X8_TYPES:
            if t == Q4_K:
                packed = repack_q4_k_x8(data, release=release)
            elif t == Q6_K:
                packed = repack_q6_k_x8(data, release=release)
            elif t == Q8_0:
                packed = repack_q8_0_x8(data, release=release)
            else:
                packed = repack_q4_x8(data, t, release=release)
            return packed, kernel_type + INT8_ACTIVATIONS
    return data, kernel_type


@njit(cache=True)
def kernel_row_bytes(kernel_type, K):
    """Bytes per weight row of a kernel type id (``quant_kernel_type``'s, or ``kernel_layout``'s
    ``*_X8``) for rows of ``K`` values; compiled code only."""
    if kernel_type == Q4_K_X8:
        return x8_row_bytes(K)
    t = kernel_type % INT8_ACTIVATIONS   # Q6_K_X8's and Q8_0_X8's rows: their type's size
    return K // _BLOCK_SIZES[t, 0] * _BLOCK_SIZES[t, 1]


_BLOCK_SIZES = np.zeros((max(QUANT_TYPES) + 1, 2), np.int64)   # (values, bytes) per block by type id
for _q in QUANT_TYPES.values():
    _BLOCK_SIZES[_q.id] = _q.block_values, _q.block_bytes


def quant_linear_tasks(N: int, K: int, threads: int) -> int:
    """Tasks of ``quant_linear_into`` for an ``[N, K]`` weight on ``threads`` threads: 1 (the calling
    thread) below ``_PARALLEL_MIN_WEIGHTS`` weights or one thread, else ``threads``."""
    return 1 if threads < 2 or N * K < _PARALLEL_MIN_WEIGHTS else threads


def _check_weight(w: np.ndarray, qtype, K: int):
    q = quant_type(qtype)   # UnsupportedQuantType for a type outside the list
    if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError(f"a {q.name} weight must be a C-contiguous uint8 array [rows, row bytes], got "
                         f"{w.dtype} {w.shape}")
    if w.shape[1] != row_bytes(q, K):   # ValueError where K is not whole blocks
        raise ValueError(f"a {q.name} row of {K} values is {row_bytes(q, K)} bytes; the weight's rows are "
                         f"{w.shape[1]}")
    return q


def quant_linear(x: np.ndarray, w: np.ndarray, qtype, out: np.ndarray | None = None,
                 activations: str = "float32") -> np.ndarray:
    """``x [T, K]`` float32 @ ``dequantize(w, qtype) [N, K]``.T -> ``[T, N]`` float32.

    Args:
        x: ``[T, K]`` activations (converted to C-contiguous float32 if needed).
        w: uint8 ``[N, row_bytes(qtype, K)]``, C-contiguous: ``N`` rows of GGUF blocks (a GGUF
            tensor's data as gguf-py reads it, memory-mapped or not).
        qtype: the weight's type (a GGML type id, a name or a ``QuantType``).
        out: optional C-contiguous float32 ``[T, N]`` to write into.
        activations: ``"float32"`` (default) or ``"int8"`` (``quant_kernel_type``: ``x`` quantized
            per 32 values, integer dot products, for the types that have them).

    Returns:
        ``out`` (or a new array): with float32 activations each entry a float32 dot product of
        ``K`` terms with the weight's exactly dequantized values (error at most ``gamma(K) sum
        |x_k w_k|``, any summation order); with int8 activations, plus the activations' rounding
        (at most half a block's scale each: ``tests/kernels/test_quant_int8.py`` derives the bound).

    Raises:
        UnsupportedQuantType: ``qtype`` is not one of the supported types.
        ValueError: ``K`` is not a whole number of blocks of the type (GGUF rows are whole blocks),
            the weight's rows are not ``row_bytes(qtype, K)`` bytes, ``out`` has another shape or
            dtype, or ``activations`` is not one of ``ACTIVATIONS``.
    """
    x = np.ascontiguousarray(x, dtype=_F32)
    if x.ndim != 2:
        raise ValueError(f"x must be [T, K], got shape {x.shape}")
    T, K = x.shape
    q = _check_weight(w, qtype, K)
    N = w.shape[0]
    if out is None:
        out = np.empty((T, N), _F32)
    elif out.shape != (T, N) or out.dtype != _F32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {(T, N)}, got {out.dtype} {out.shape}")
    if T == 0 or N == 0:
        return out
    kt = quant_kernel_type(q, activations)
    tasks = quant_linear_tasks(N, K, num_threads())
    scratch = quant_scratch(tasks, T, K)
    with region_guard():
        quant_linear_into(x, w, kt, out, scratch, tasks)
    return out


@njit(cache=True, nogil=True)
def _embedding_into(table, qtype, ids, out):
    for t in range(ids.shape[0]):
        decode_row(table[ids[t]], qtype, out[t])


def quant_embedding(table: np.ndarray, qtype, ids: np.ndarray, hidden_size: int) -> np.ndarray:
    """Rows ``ids`` of a quantized embedding table, dequantized: float32 ``[T, hidden_size]``,
    bit-identical to ``dequantize(table[ids], qtype)``.

    Args:
        table: uint8 ``[vocab, row_bytes(qtype, hidden_size)]``, C-contiguous.
        qtype: the table's type (see ``quant_linear``).
        ids: ``[T]`` integer token ids.
        hidden_size: ``K``, the values per row.

    Raises:
        UnsupportedQuantType: see ``quant_linear``.
        ValueError: a row size that does not match, or an id outside ``[0, vocab)``.
    """
    q = _check_weight(table, qtype, hidden_size)
    ids = _checked_ids(ids, table.shape[0])
    out = np.empty((ids.shape[0], hidden_size), _F32)
    _embedding_into(table, q.id, ids, out)
    return out


def _checked_ids(ids, rows: int) -> np.ndarray:
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        bad = ids[(ids < 0) | (ids >= rows)][0]
        raise ValueError(f"token id {bad} is outside the embedding table's {rows} rows")
    return ids


def interleaved_embedding(packed: np.ndarray, qtype, ids: np.ndarray, hidden_size: int) -> np.ndarray:
    """``quant_embedding`` of a table in ``kernel_layout``'s interleaved layout (``packed``, uint8
    ``[vocab, row bytes]``, GGML type ``qtype``, one of ``X8_TYPES``): float32 ``[T, hidden_size]``,
    bit-identical to ``dequantize`` of the GGUF rows (``quant_x8.x8_decode_rows``).

    Raises:
        ValueError: an id outside ``[0, vocab)``, or a type without an interleaved layout.
    """
    q = quant_type(qtype)
    if q.id not in X8_TYPES:
        raise ValueError(f"{q.name} has no interleaved layout")
    ids = _checked_ids(ids, packed.shape[0])
    out = np.empty((ids.shape[0], hidden_size), _F32)
    x8_decode_rows(packed, q.id, ids, out)
    return out


# ----------------------------------------------------------------------------------------------
# compiled ahead (compile_jobs.py; runtime/worker/precompile.py through the table)
# ----------------------------------------------------------------------------------------------

# the products' entry (forward.product_item): quant_task_rows_f32, or with int8 activations
# quant_task_rows (which calls it too); lm_head and the embedding are a read-only mapped tensor
_TASK_ROWS = "F2 U2 i64 F2 i64 F2 u64 i64 i64"
PRECOMPILE = (
    NumbaJob(quant_task_rows_f32, _TASK_ROWS, "linear", 8.5, "matrix products from GGUF blocks", ("quantized",)),
    NumbaJob(quant_task_rows, _TASK_ROWS, "linear", 11, "matrix products from GGUF blocks", ("quantized-int8",)),
    NumbaJob(quant_item_rows, "i64 i64 i64 b1 i64", "linear", 0.1, "matrix products: rows per item", QUANTIZED),
    NumbaJob(quant_scratch, "i64 i64 i64", "linear", 0.1, "matrix products: scratch", QUANTIZED),
    NumbaJob(_embedding_into, "U2r i64 I1 F2", "rest", 3, "embedding rows from GGUF blocks", QUANTIZED),
)
