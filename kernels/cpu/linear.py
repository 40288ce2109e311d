"""Matrix products of the CPU forward pass: ``out = x @ weight.T`` for ``weight [out, in]``.

Two shapes, two kernels, both parallel over the threads of ``kernels.cpu.threads``' policy:

* **Few rows** (decode steps, ``T <= GEMV_MAX_ROWS``): one token's product is bound by reading the
  weights from memory (2 T flops per 4-byte weight); up to ``GEMV_MAX_ROWS`` tokens (64 with
  AVX-512, 24 with AVX2: the decode steps of that many sequences) a kernel that reads each weight
  once takes the place of sgemm's packed tiles. A Numba kernel streams each weight row once (four
  rows at a time, from separate places of the item, so that more reads are in flight) and takes its
  dot product with every token, ``TOKENS_PER_PASS`` tokens per pass over the rows: 4 where the
  kernels are compiled with AVX-512 (16 sums per pass: each loaded weight value feeds 4 of them and
  each token value 4, 2 multiply-adds per load), 2 with AVX2, whose 16 registers cannot hold 16
  sums. Float32, vectorised by LLVM into 8- or 16-lane partial sums added at the end, a blocked
  summation whose rounding error grows with ``K / 8`` terms, not ``K``. Tasks take blocks of
  ``GEMV_BLOCK_ROWS`` weight rows.
* **More rows** (prefill chunks, decode steps of more sequences): where the streaming kernel takes
  up to 64 tokens (AVX-512) and BLAS runs no AVX-512 kernels (``STREAM_TILES``), the same kernel on
  tiles of ``GEMV_BLOCK_ROWS`` weight rows x a chunk of at most ``GEMV_MAX_ROWS`` tokens (chunks of
  equal size), the tiles of one weight block consecutive so that it is read from L2 (in place of
  OpenBLAS's AVX2 kernels, which this project's environment selects). Otherwise BLAS ``sgemm`` on
  2-D tiles of the output (``tile_m`` tokens x ``tile_n`` weight rows), each tile one
  single-threaded call, tiles taken by the threads from a shared counter. Each call packs its own
  weight tile; tiles are large enough (>= 64 x 64 outputs over the whole ``K``) that the packing
  stays a small share.

Source: the GotoBLAS/BLIS layered GEMM (Goto & van de Geijn 2008, "Anatomy of High-Performance
Matrix Multiplication") for why tiles of the output are independent units of work.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, prange

from .compile_jobs import NumbaJob
from .simd import compiles_avx512
from .threads import NO_TRANS, ROW_MAJOR, TRANS, fetch_add, num_threads, ptr, region_guard, sgemm

__all__ = ["linear", "linear_into", "linear_items", "linear_item", "linear_plan", "gemm_tiles", "GEMV_MAX_ROWS",
           "TOKENS_PER_PASS"]

_F32 = np.float32


_WIDE = compiles_avx512()
# tokens per pass of the streaming kernel: 4 x 4 (token, weight row) sums need 16 vector
# accumulators, which AVX2's 16 registers cannot hold beside the loaded values (6 of them
# spilled to the stack, reloaded and stored every iteration)
TOKENS_PER_PASS = 4 if _WIDE else 2
# up to this many tokens the streaming kernel, else sgemm tiles (OpenBLAS packs and computes a
# thin output poorly): 64 in AVX-512 code, 24 in AVX2 code, about where each meets the tiles' rate
GEMV_MAX_ROWS = 64 if _WIDE else 24
GEMV_BLOCK_ROWS = 32       # weight rows per work item of the streaming kernel


def _blas_runs_avx512() -> bool:
    # whether the loaded OpenBLAS runs its AVX-512 kernels (its core type, as threadpoolctl
    # reports it; OPENBLAS_CORETYPE, where set, decides it); False for another BLAS or none
    from threadpoolctl import threadpool_info
    arch = next((i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"), None)
    return (arch or "").lower() in ("skylakex", "cooperlake", "sapphirerapids")


# Above GEMV_MAX_ROWS tokens: the streaming kernel on tiles of GEMV_BLOCK_ROWS weight rows x
# token chunks of at most GEMV_MAX_ROWS where it takes 64 tokens (AVX-512) and sgemm does not
# run AVX-512 kernels, else sgemm tiles
STREAM_TILES = GEMV_MAX_ROWS >= 64 and not _blas_runs_avx512()
_PARALLEL_MIN_WEIGHTS = 1 << 16   # smaller weights: run on the calling thread


@njit(cache=True, fastmath=True)
def _dot1x4(x, t, weight, ra, rb, rc, rd, out):
    # one token against 4 weight rows read as 4 concurrent streams
    a = _F32(0.0)
    b = _F32(0.0)
    c = _F32(0.0)
    d = _F32(0.0)
    for k in range(x.shape[1]):
        v = x[t, k]
        a += v * weight[ra, k]
        b += v * weight[rb, k]
        c += v * weight[rc, k]
        d += v * weight[rd, k]
    out[t, ra] = a
    out[t, rb] = b
    out[t, rc] = c
    out[t, rd] = d


@njit(cache=True, fastmath=True)
def _dot4x4(x, t, weight, ra, rb, rc, rd, out):
    # tokens t .. t + 4 against 4 weight rows (4 streams): each loaded weight value feeds 4 sums,
    # each loaded token value 4 (16 vector accumulators: fits AVX-512's 32 registers)
    a0 = a1 = a2 = a3 = _F32(0.0)
    b0 = b1 = b2 = b3 = _F32(0.0)
    c0 = c1 = c2 = c3 = _F32(0.0)
    d0 = d1 = d2 = d3 = _F32(0.0)
    for k in range(x.shape[1]):
        x0 = x[t, k]
        x1 = x[t + 1, k]
        x2 = x[t + 2, k]
        x3 = x[t + 3, k]
        wa = weight[ra, k]
        wb = weight[rb, k]
        wc = weight[rc, k]
        wd = weight[rd, k]
        a0 += x0 * wa
        a1 += x1 * wa
        a2 += x2 * wa
        a3 += x3 * wa
        b0 += x0 * wb
        b1 += x1 * wb
        b2 += x2 * wb
        b3 += x3 * wb
        c0 += x0 * wc
        c1 += x1 * wc
        c2 += x2 * wc
        c3 += x3 * wc
        d0 += x0 * wd
        d1 += x1 * wd
        d2 += x2 * wd
        d3 += x3 * wd
    out[t, ra], out[t + 1, ra], out[t + 2, ra], out[t + 3, ra] = a0, a1, a2, a3
    out[t, rb], out[t + 1, rb], out[t + 2, rb], out[t + 3, rb] = b0, b1, b2, b3
    out[t, rc], out[t + 1, rc], out[t + 2, rc], out[t + 3, rc] = c0, c1, c2, c3
    out[t, rd], out[t + 1, rd], out[t + 2, rd], out[t + 3, rd] = d0, d1, d2, d3


@njit(cache=True, fastmath=True)
def _dot2x4(x, t, weight, ra, rb, rc, rd, out):
    # tokens t, t + 1 against 4 weight rows (4 streams)
    a0 = a1 = b0 = b1 = c0 = c1 = d0 = d1 = _F32(0.0)
    for k in range(x.shape[1]):
        x0 = x[t, k]
        x1 = x[t + 1, k]
        wa = weight[ra, k]
        wb = weight[rb, k]
        wc = weight[rc, k]
        wd = weight[rd, k]
        a0 += x0 * wa
        a1 += x1 * wa
        b0 += x0 * wb
        b1 += x1 * wb
        c0 += x0 * wc
        c1 += x1 * wc
        d0 += x0 * wd
        d1 += x1 * wd
    out[t, ra], out[t + 1, ra] = a0, a1
    out[t, rb], out[t + 1, rb] = b0, b1
    out[t, rc], out[t + 1, rc] = c0, c1
    out[t, rd], out[t + 1, rd] = d0, d1


@njit(cache=True, fastmath=True)
def _dot1(x, t, weight, r, out):
    a = _F32(0.0)
    for k in range(x.shape[1]):
        a += x[t, k] * weight[r, k]
    out[t, r] = a


@njit(cache=True, fastmath=True)
def _gemv_rows(x, weight, out, r0, r1, t0, t1):
    # out[t0:t1, r0:r1] = x[t0:t1] @ weight[r0:r1].T. Four weight rows at a time, read as
    # interleaved streams (rows r0 + i, r0 + i + n/4, ...: one core then keeps more memory reads in
    # flight than with one sequential stream), against every token, TOKENS_PER_PASS tokens per pass
    # (the rows stay in L1 or L2 for the later passes), then pairs, then one
    n = r1 - r0
    q = n // 4
    for i in range(q):
        ra, rb, rc, rd = r0 + i, r0 + q + i, r0 + 2 * q + i, r0 + 3 * q + i
        t = t0
        if TOKENS_PER_PASS == 4:
            while t1 - t >= 4:
                _dot4x4(x, t, weight, ra, rb, rc, rd, out)
                t += 4
        while t1 - t >= 2:
            _dot2x4(x, t, weight, ra, rb, rc, rd, out)
            t += 2
        if t1 - t == 1:
            _dot1x4(x, t, weight, ra, rb, rc, rd, out)
    for r in range(r0 + 4 * q, r1):
        for t in range(t0, t1):
            _dot1(x, t, weight, r, out)


@njit(cache=True)
def _stream_chunks(T):
    # token chunks of the streaming kernel above GEMV_MAX_ROWS tokens: the fewest of at most
    # GEMV_MAX_ROWS, of equal size within one token
    return (T + GEMV_MAX_ROWS - 1) // GEMV_MAX_ROWS


@njit(cache=True)
def _stream_tile(x, weight, out, i, n_chunks):
    # item i of a streamed product of more than GEMV_MAX_ROWS tokens: weight block i // n_chunks
    # (GEMV_BLOCK_ROWS rows; consecutive items share it, from L2) against token chunk i % n_chunks
    T, N = x.shape[0], weight.shape[0]
    b, c = i // n_chunks, i % n_chunks
    _gemv_rows(x, weight, out, b * GEMV_BLOCK_ROWS, min(N, (b + 1) * GEMV_BLOCK_ROWS), T * c // n_chunks,
               T * (c + 1) // n_chunks)


@njit(cache=True)
def _gemm_tile(x, weight, out, m0, m1, n0, n1):
    K, N = x.shape[1], weight.shape[0]
    sgemm(ROW_MAJOR, NO_TRANS, TRANS, m1 - m0, n1 - n0, K, _F32(1.0), ptr(x, m0 * K), K, ptr(weight, n0 * K), K,
          _F32(0.0), ptr(out, m0 * N + n0), N)


@njit(cache=True)
def linear_items(T, N, tasks, tile_m, tile_n):
    """Work items of ``out [T, N] = x @ weight.T`` as planned by ``linear_plan``: 1 on the calling
    thread (``tasks == 1``), else blocks of ``GEMV_BLOCK_ROWS`` weight rows (up to
    ``GEMV_MAX_ROWS`` tokens), streamed tiles (``tile_m == 0``: weight blocks x token chunks) or
    ``tile_m x tile_n`` sgemm tiles; 0 when ``T == 0``."""
    if T == 0:
        return 0
    if tasks == 1:
        return 1
    if T <= GEMV_MAX_ROWS:
        return (N + GEMV_BLOCK_ROWS - 1) // GEMV_BLOCK_ROWS
    if tile_m == 0:
        return _stream_chunks(T) * ((N + GEMV_BLOCK_ROWS - 1) // GEMV_BLOCK_ROWS)
    return ((T + tile_m - 1) // tile_m) * ((N + tile_n - 1) // tile_n)


@njit(cache=True)
def linear_item(x, weight, out, tasks, tile_m, tile_n, i):
    """Item ``i`` of ``linear_items``, on the calling thread (any task of any region may run it)."""
    T, N = x.shape[0], weight.shape[0]
    if tasks == 1:
        if T <= GEMV_MAX_ROWS:
            _gemv_rows(x, weight, out, 0, N, 0, T)
        elif tile_m == 0:
            n_chunks = _stream_chunks(T)
            for j in range(n_chunks * ((N + GEMV_BLOCK_ROWS - 1) // GEMV_BLOCK_ROWS)):
                _stream_tile(x, weight, out, j, n_chunks)
        else:
            _gemm_tile(x, weight, out, 0, T, 0, N)
    elif T <= GEMV_MAX_ROWS:
        _gemv_rows(x, weight, out, i * GEMV_BLOCK_ROWS, min(N, (i + 1) * GEMV_BLOCK_ROWS), 0, T)
    elif tile_m == 0:
        _stream_tile(x, weight, out, i, _stream_chunks(T))
    else:
        n_m = (T + tile_m - 1) // tile_m
        jn = i // n_m   # column-tile major: consecutive items share one weight tile
        im = i - jn * n_m
        _gemm_tile(x, weight, out, im * tile_m, min(T, (im + 1) * tile_m), jn * tile_n, min(N, (jn + 1) * tile_n))


@njit(parallel=True, cache=True)
def _linear_parallel(x, weight, out, tile_m, tile_n, n_tasks, counter):
    n_items = linear_items(x.shape[0], weight.shape[0], n_tasks, tile_m, tile_n)
    for _task in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= n_items:
                break
            linear_item(x, weight, out, n_tasks, tile_m, tile_n, i)


@njit(cache=True, nogil=True)
def linear_into(x, weight, out, tasks, tile_m, tile_n):
    """``out[:] = x @ weight.T`` from compiled code (``linear`` and the fused forward of
    ``kernels/cpu/forward.py``), as planned by ``linear_plan``: C-contiguous float32 ``x [T, in]``,
    ``weight [out, in]``, ``out [T, out]``; ``tasks`` 1 (the calling thread) or the threads of
    the region; ``(tile_m, tile_n)`` how a product of more than ``GEMV_MAX_ROWS`` rows is cut
    (``linear_plan``)."""
    if x.shape[0] == 0:
        return
    if tasks > 1:
        _linear_parallel(x, weight, out, tile_m, tile_n, tasks, np.zeros(1, np.int64))
    else:
        linear_item(x, weight, out, 1, tile_m, tile_n, 0)


def linear_plan(T: int, weight_shape: tuple, threads: int) -> tuple[int, int, int]:
    """``(tasks, tile_m, tile_n)`` of ``linear_into`` for ``T`` rows against a weight of
    ``weight_shape`` on ``threads`` threads: one task (the calling thread) for weights under
    ``_PARALLEL_MIN_WEIGHTS`` elements; above ``GEMV_MAX_ROWS`` rows ``tile_m == 0`` for the
    streamed tiles (``STREAM_TILES``), else sgemm tiles (``gemm_tiles``; the whole output on one
    task)."""
    N, K = weight_shape
    tasks = 1 if threads < 2 or N * K < _PARALLEL_MIN_WEIGHTS else threads
    if T <= GEMV_MAX_ROWS or STREAM_TILES:
        return tasks, 0, 0
    return (tasks,) + (gemm_tiles(T, N, threads) if tasks > 1 else (max(1, T), max(1, N)))


@functools.lru_cache(maxsize=4096)  # called per product; the answer depends on these three only
def gemm_tiles(T: int, N: int, threads: int) -> tuple[int, int]:
    """``(tile_m, tile_n)`` of an ``[T, N]`` output for ``threads`` threads.

    Each tile is one single-threaded sgemm call, which packs its ``tile_m`` rows of ``x`` and its
    ``tile_n`` weight rows (over the whole ``K``) before computing ``tile_m x tile_n`` outputs, so
    the packing share of a tile goes as ``1 / tile_m + 1 / tile_n``: tiles as square as the
    output allows. Among cuts into ``n_m`` row tiles (at least 64 tokens, at most 512) and
    weight-row tiles (multiples of 16, 64..512) that give about 4 tiles per thread (dynamic
    balance) where the output has room, the one with the least packing per output.
    """
    target = 4 * threads
    best = None
    for n_m in range(max(1, -(-T // 512)), max(1, T // 64) + 1):
        tile_m = -(-T // n_m)
        tile_n = -(-N // max(1, -(-target // n_m)))
        tile_n = min(512, max(64, -(-tile_n // 16) * 16))
        tiles = n_m * -(-N // tile_n)
        key = (tiles < target, 1 / tile_m + 1 / tile_n)
        if best is None or key < best[0]:
            best = (key, tile_m, tile_n)
    return best[1], best[2]


def linear(x, weight, out=None):
    """``x [T, in]`` float32 @ ``weight [out, in]``.T -> ``[T, out]`` float32 (into ``out`` when
    given, else a new C-contiguous array).

    ``T <= GEMV_MAX_ROWS``: the weight-streaming kernel; more rows: the same kernel on streamed
    tiles (``STREAM_TILES``) or sgemm tiles (see the module docstring). ``weight`` must be
    C-contiguous float32 (``prepare_weight``); ``x`` may be any float32 view (copied to contiguous
    rows if needed); ``out``, when given, ``[T, out]`` float32 (a buffer that is not C-contiguous
    gets the result copied in).
    """
    x = np.ascontiguousarray(x, dtype=_F32)
    T, N = x.shape[0], weight.shape[0]
    if out is not None and not (out.flags.c_contiguous and out.dtype == _F32):
        out[...] = linear(x, weight)
        return out
    out = np.empty((T, N), dtype=_F32) if out is None else out
    if T == 0:
        return out
    with region_guard():
        linear_into(x, weight, out, *linear_plan(T, weight.shape, num_threads()))
    return out

# ----------------------------------------------------------------------------------------------
# compiled ahead (compile_jobs.py; runtime/worker/precompile.py through the table)
# ----------------------------------------------------------------------------------------------

PRECOMPILE = (   # float32 weights only (GGUF-typed ones: quant_linear.py)
    NumbaJob(linear_item, "F2 F2 F2 i64 i64 i64 i64", "linear", 10, "matrix products", ("float32",)),
    NumbaJob(linear_items, "i64 i64 i64 i64 i64", "linear", 0.4, "matrix products: work items", ("float32",)),
    NumbaJob(linear_into, "F2 F2 F2 i64 i64 i64", "rest", 7, "matrix products, parallel region (lm_head)",
             ("float32",)),
)
