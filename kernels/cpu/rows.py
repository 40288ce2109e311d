"""Numba row kernels: KV block copies, RMSNorm, RoPE with the KV-cache append, SiLU-and-mul, embedding.

Every public function has the signature of its ``kernels/reference.py`` twin (see that module for
the batch, KV-cache and slot-mapping conventions) and is tested against it in
``tests/kernels/test_kernels_cpu.py``. The compiled bodies are ``@njit(cache=True)`` so that the second
process start reuses the machine code; each has a serial driver and a ``parallel=True`` /
``prange`` driver, and the parallel one runs only when the call has enough work to pay for waking
the thread pool. ``forward.py`` links the ``*_rows`` / ``*_into`` bodies into its layer loop.

Sources: RMSNorm (Zhang & Sennrich 2019), RoPE (Su et al. 2021), SwiGLU (Shazeer 2020); Numba's
parallel ``prange`` (numba.readthedocs.io, "Automatic parallelization with @jit").
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .compile_jobs import NumbaJob
from .kv_dtype import from_f32
from .math import LOG2E, exp2
from .memory import HUGE_PAGE_MIN_BYTES, huge_page_zeros
from .threads import fetch_add, num_threads, region_guard

_F32 = np.float32
_PARALLEL_MIN_ELEMENTS = 1 << 16     # row ops: below this many input elements, the calling thread
_ROWS_PER_ITEM = 16                  # row ops: rows per work item of a parallel region


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _copy_blocks_kernel(cache, block_mapping):
    # element by element over the flattened blocks: a block assignment (cache[dst] = cache[src])
    # would also compile Numba's shape-mismatch message (string formatting, slow to compile) for
    # shapes that always match
    n = cache.size // max(1, cache.shape[0])
    flat = cache.reshape((cache.shape[0], n))
    for i in range(block_mapping.shape[0]):
        src, dst = block_mapping[i, 0], block_mapping[i, 1]
        for j in range(n):
            flat[dst, j] = flat[src, j]


def copy_blocks(key_caches, value_caches, block_mapping):
    """Copy whole blocks ``(src, dst)`` rows of ``block_mapping [N, 2]`` in every layer, in place.

    Rows are applied in order, as in ``reference.copy_blocks``. Any cache dtype (bit copies).
    """
    mapping = np.asarray(block_mapping, dtype=np.int64).reshape(-1, 2)
    if mapping.shape[0] == 0:
        return
    for kc, vc in zip(key_caches, value_caches):
        _copy_blocks_kernel(kc, mapping)
        _copy_blocks_kernel(vc, mapping)


# ----------------------------------------------------------------------------------------------
# norms, rope, activation
# ----------------------------------------------------------------------------------------------


# Each row kernel is a body over rows [t0, t1) plus a serial and a parallel driver; the parallel
# one runs only when there is enough work to pay for waking the pool (a decode step's rows are
# tiny) and splits the rows into items of _ROWS_PER_ITEM taken from a shared counter.


@njit(cache=True, fastmath=True)
def _rms_norm_rows(x, weight, eps, out, t0, t1):
    N = x.shape[1]
    for t in range(t0, t1):
        ss = 0.0
        for i in range(N):
            v = np.float64(x[t, i])
            ss += v * v
        r = np.float32(1.0 / math.sqrt(ss / N + eps))
        for i in range(N):
            out[t, i] = x[t, i] * r * weight[i]


@njit(parallel=True, cache=True)
def _rms_norm_parallel(x, weight, eps, out, rows, n_tasks, counter):
    T = x.shape[0]
    for _task in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= (T + rows - 1) // rows:
                break
            _rms_norm_rows(x, weight, eps, out, i * rows, min(T, (i + 1) * rows))


@njit(cache=True, fastmath=True)
def _fused_add_rms_norm_rows(x, residual, weight, eps, out, new_residual, t0, t1):
    N = x.shape[1]
    for t in range(t0, t1):
        ss = 0.0
        for i in range(N):
            v = x[t, i] + residual[t, i]
            new_residual[t, i] = v
            v64 = np.float64(v)
            ss += v64 * v64
        r = np.float32(1.0 / math.sqrt(ss / N + eps))
        for i in range(N):
            out[t, i] = new_residual[t, i] * r * weight[i]


@njit(parallel=True, cache=True)
def _fused_add_rms_norm_parallel(x, residual, weight, eps, out, new_residual, rows, n_tasks, counter):
    T = x.shape[0]
    for _task in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= (T + rows - 1) // rows:
                break
            _fused_add_rms_norm_rows(x, residual, weight, eps, out, new_residual, i * rows, min(T, (i + 1) * rows))


@njit(cache=True, nogil=True)
def rms_norm_into(x, weight, eps, out, tasks, rows_per_item):
    """``rms_norm`` from compiled code: on the calling thread (``tasks == 1``) or ``tasks``
    threads taking ``rows_per_item`` rows at a time (``row_tasks`` plans both)."""
    if tasks == 1:
        _rms_norm_rows(x, weight, eps, out, 0, x.shape[0])
    else:
        _rms_norm_parallel(x, weight, eps, out, rows_per_item, tasks, np.zeros(1, np.int64))


@njit(cache=True, nogil=True)
def fused_add_rms_norm_into(x, residual, weight, eps, out, new_residual, tasks, rows_per_item):
    """``fused_add_rms_norm`` (all rows) from compiled code; ``tasks`` as in ``rms_norm_into``."""
    if tasks == 1:
        _fused_add_rms_norm_rows(x, residual, weight, eps, out, new_residual, 0, x.shape[0])
    else:
        _fused_add_rms_norm_parallel(x, residual, weight, eps, out, new_residual, rows_per_item, tasks,
                                     np.zeros(1, np.int64))


def row_tasks(n_elements: int, n_rows: int, threads: int) -> int:
    """Tasks of a row kernel's call: 1 (the calling thread) for small work, else ``threads``."""
    if n_elements < _PARALLEL_MIN_ELEMENTS or n_rows < 2 or threads < 2:
        return 1
    return threads


def _tasks(n_elements: int, n_rows: int) -> int:
    return row_tasks(n_elements, n_rows, num_threads())


def rms_norm(x, weight, eps, out=None):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    ``x [T, hidden]`` float32, ``weight [hidden]`` float32; returns ``[T, hidden]`` float32 (into
    ``out`` when given).
    """
    out = np.empty(x.shape, dtype=_F32) if out is None else out
    with region_guard():
        rms_norm_into(x, weight, float(eps), out, _tasks(x.size, x.shape[0]), _ROWS_PER_ITEM)
    return out


def fused_add_rms_norm(x, residual, weight, eps, out=None, residual_out=None, rows=None):
    """Residual add then RMSNorm in one pass; returns ``(rms_norm(x + residual), x + residual)``.

    ``x, residual [T, hidden]`` float32. ``out`` / ``residual_out``: optional output buffers
    (``residual_out`` may be ``residual``: each element is read before it is written). With
    ``rows`` (``[R]`` int64) only those rows are normalised and ``(out [R, hidden], None)`` is
    returned (the final norm before ``lm_head``).
    """
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64)
        normed, _ = fused_add_rms_norm(x[rows], residual[rows], weight, eps, out=out)
        return normed, None
    out = np.empty(x.shape, dtype=_F32) if out is None else out
    new_residual = np.empty(x.shape, dtype=_F32) if residual_out is None else residual_out
    with region_guard():
        fused_add_rms_norm_into(x, residual, weight, float(eps), out, new_residual, _tasks(x.size, x.shape[0]),
                                _ROWS_PER_ITEM)
    return out, new_residual


@njit(cache=True, fastmath=True, error_model="numpy")
def _silu_and_mul_rows(x, out, t0, t1):
    # silu(g) = g / (1 + e^-g), e^-g = 2^(-g log2 e) (vectorised, see kernels/cpu/math.py). error_model
    # "numpy": Python's model checks each division for a zero divisor, a branch that keeps LLVM
    # from vectorising the loop
    inter = out.shape[1]
    for t in range(t0, t1):
        for i in range(inter):
            g = x[t, i]
            out[t, i] = g / (_F32(1.0) + exp2(g * _F32(-LOG2E))) * x[t, inter + i]


@njit(parallel=True, cache=True)
def _silu_and_mul_parallel(x, out, rows, n_tasks, counter):
    T = x.shape[0]
    for _task in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= (T + rows - 1) // rows:
                break
            _silu_and_mul_rows(x, out, i * rows, min(T, (i + 1) * rows))


@njit(cache=True, nogil=True)
def silu_and_mul_into(x, out, tasks, rows_per_item):
    """``silu_and_mul`` from compiled code; ``tasks`` as in ``rms_norm_into``."""
    if tasks == 1:
        _silu_and_mul_rows(x, out, 0, x.shape[0])
    else:
        _silu_and_mul_parallel(x, out, rows_per_item, tasks, np.zeros(1, np.int64))


def silu_and_mul(x, out=None):
    """SwiGLU activation (Shazeer 2020): ``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` float32
    (into ``out`` when given)."""
    T = x.shape[0]
    out = np.empty((T, x.shape[1] // 2), dtype=_F32) if out is None else out
    with region_guard():
        silu_and_mul_into(x, out, _tasks(x.size, T), _ROWS_PER_ITEM)
    return out


# ----------------------------------------------------------------------------------------------
# weights and embeddings (matrix products: kernels/cpu/linear.py)
# ----------------------------------------------------------------------------------------------


def prepare_weight(w):
    """A weight as the CPU table stores it: a C-contiguous float32 copy of ``w`` (``[out, in]`` or
    ``[n]``). Linear weights stay ``[out, in]``: the decode kernel then streams contiguous rows and
    BLAS takes ``W.T`` as a transpose flag.
    Weights of 2 MiB and more go on transparent huge pages (``memory.huge_page_zeros``, kernels/cpu/memory.py)."""
    if np.size(w) * 4 < HUGE_PAGE_MIN_BYTES:
        return np.ascontiguousarray(w, dtype=_F32)
    out = huge_page_zeros(np.shape(w), _F32)   # streamed every decode step: on huge pages (kernels/cpu/memory.py)
    out[...] = w
    return out


def embedding(ids, table, out=None):
    """Rows of ``table [vocab, hidden]`` for ``ids [T]`` int64 -> ``[T, hidden]`` float32 (into
    ``out`` when given).

    Raises:
        IndexError: an id outside ``[0, vocab)``.
    """
    return np.take(table, np.asarray(ids, dtype=np.int64), axis=0, out=out)


@njit(cache=True, fastmath=True)
def _rope_and_cache_rows(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, out, t0, t1):
    # per token: the rotated query heads into out, the rotated key heads and the value heads
    # straight into their cache slot (no intermediate arrays)
    D = cos_sin_cache.shape[1]
    half = D // 2
    bs = key_cache.shape[1]
    for t in range(t0, t1):
        p = positions[t]
        for h in range(H):
            for i in range(half):
                c = cos_sin_cache[p, i]
                s = cos_sin_cache[p, half + i]
                x1 = qkv[t, h * D + i]
                x2 = qkv[t, h * D + half + i]
                out[t, h, i] = x1 * c - x2 * s
                out[t, h, half + i] = x2 * c + x1 * s
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b = slot // bs
        o = slot - b * bs
        for h in range(Hkv):
            k0 = (H + h) * D
            v0 = (H + Hkv + h) * D
            for i in range(half):
                c = cos_sin_cache[p, i]
                s = cos_sin_cache[p, half + i]
                x1 = qkv[t, k0 + i]
                x2 = qkv[t, k0 + half + i]
                key_cache[b, o, h, i] = from_f32(x1 * c - x2 * s, key_cache)
                key_cache[b, o, h, half + i] = from_f32(x2 * c + x1 * s, key_cache)
            for i in range(D):
                value_cache[b, o, h, i] = from_f32(qkv[t, v0 + i], value_cache)


@njit(parallel=True, cache=True)
def _rope_and_cache_parallel(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, out, rows,
                             n_tasks, counter):
    T = qkv.shape[0]
    for _task in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= (T + rows - 1) // rows:
                break
            _rope_and_cache_rows(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, out,
                                 i * rows, min(T, (i + 1) * rows))


@njit(cache=True, nogil=True)
def rope_and_cache_into(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, out, tasks,
                        rows_per_item):
    """``rope_and_cache`` from compiled code (int64 ``positions`` and ``slot_mapping``);
    ``tasks`` as in ``rms_norm_into``."""
    if tasks == 1:
        _rope_and_cache_rows(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, out, 0,
                             qkv.shape[0])
    else:
        _rope_and_cache_parallel(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, H, Hkv, out,
                                 rows_per_item, tasks, np.zeros(1, np.int64))


def rope_and_cache(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                   num_kv_heads, out=None):
    """``reference.rope_and_cache`` in one pass: RoPE on the q / k slices of the fused projection
    ``qkv [T, (H + 2 Hkv) * D]`` float32 (rows may be strided), the rotated keys and the values
    written to their cache slots (``slot_mapping [T]``, -1 = skip; float32 caches, or bfloat16 bits
    as uint16 rounded to nearest even); returns the rotated queries ``[T, H, D]`` float32 (into
    ``out`` when given)."""
    T = qkv.shape[0]
    D = cos_sin_cache.shape[1]
    out = np.empty((T, num_heads, D), dtype=_F32) if out is None else out
    args = (np.asarray(positions, dtype=np.int64), qkv, cos_sin_cache, key_cache, value_cache,
            np.asarray(slot_mapping, dtype=np.int64), num_heads, num_kv_heads, out)
    with region_guard():
        rope_and_cache_into(*args, _tasks(qkv.size, T), _ROWS_PER_ITEM)
    return out

# ----------------------------------------------------------------------------------------------
# compiled ahead (compile_jobs.py; runtime/worker/precompile.py through the table)
# ----------------------------------------------------------------------------------------------

PRECOMPILE = (
    NumbaJob(_rms_norm_rows, "F2 F1 f64 F2 i64 i64", "linear", 0.4, "RMSNorm"),
    NumbaJob(_fused_add_rms_norm_rows, "F2 F2 F1 f64 F2 F2 i64 i64", "linear", 0.4, "residual add + RMSNorm"),
    NumbaJob(_rope_and_cache_rows, "I1 F2 F2 F4 F4 I1 i64 i64 F3 i64 i64", "linear", 1.1, "RoPE and KV-cache append"),
    NumbaJob(_silu_and_mul_rows, "F2 F2 i64 i64", "linear", 0.3, "SwiGLU"),
    NumbaJob(fused_add_rms_norm_into, "F2 F2 F1 f64 F2 F2 i64 i64", "rest", 1.8,
             "residual add + RMSNorm, parallel region (final norm)"),
    NumbaJob(_copy_blocks_kernel, "F4 I2", "rest", 0.1, "KV block copies (copy-on-write)"),
)
