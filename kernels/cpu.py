"""Numba CPU kernels: the operations of ``kernels/reference.py`` compiled for speed, float32.

Every public function has the signature of its reference twin (see that module for the batch,
KV-cache and slot-mapping conventions) and is tested against it in ``tests/test_kernels_cpu.py``.
The compiled bodies are ``@njit(cache=True)`` so that the second process start reuses the machine
code; each has a serial driver and a ``parallel=True`` / ``prange`` driver, and the parallel one
runs only when the call has enough work to pay for the thread pool. Matrix products
(``linear``) use NumPy's BLAS, except matrix-vector products of decode steps (a Numba kernel).
Parallel drivers use Numba's thread pool (``NUMBA_NUM_THREADS``; 1 = everything serial); on a
machine shared with other busy processes, ``NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1`` avoids
parallel regions stalling on a descheduled worker thread.

``CPU_KERNELS`` is the kernel table the forward pass (``model/llama.py``) is written against.

Sources: PagedAttention (Kwon et al., SOSP 2023); the online ("streaming") softmax of Milakov &
Gimelshein 2018, as used by FlashAttention (Dao et al., 2022), applied one KV block at a time;
Numba's parallel ``prange`` (numba.readthedocs.io, "Automatic parallelization with @jit").
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numba
import numpy as np
from numba import njit, prange

from . import reference

__all__ = [
    "paged_attention",
    "reshape_and_cache",
    "copy_blocks",
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "rope_and_cache",
    "silu_and_mul",
    "linear",
    "embedding",
    "prepare_weight",
    "CPU_KERNELS",
]

_F32 = np.float32
# below these sizes a kernel runs on the calling thread (see the note above the row kernels)
_PARALLEL_MIN_ELEMENTS = 1 << 16     # row ops: elements of the input
_PARALLEL_MIN_WORK = 1 << 20         # paged attention: multiply-adds of QK^T (same again for PV)
_GEMV_MAX_ROWS = 4                   # linear: up to this many tokens use the Numba kernel, else BLAS


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


@njit(cache=True, fastmath=True)
def _attention_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
                    t, s, kvh):
    # token t of sequence s, the `group` query heads sharing kv head kvh: each K/V row is read
    # once for the group. Online softmax, one KV block (<= block_size keys) at a time.
    H, D = q.shape[1], q.shape[2]
    block_size, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = H // Hkv
    q_start = query_start_loc[s]
    q_len = query_start_loc[s + 1] - q_start
    pos = seq_lens[s] - q_len + (t - q_start)  # attends to keys 0..pos
    h0 = kvh * group
    qs = np.empty((group, D), np.float32)
    for g in range(group):
        for d in range(D):
            qs[g, d] = q[t, h0 + g, d] * scale
    m = np.full(group, -np.inf, np.float32)
    l = np.zeros(group, np.float32)
    acc = np.zeros((group, D), np.float32)
    scores = np.empty((group, block_size), np.float32)
    n_keys = pos + 1
    n_blocks = (n_keys + block_size - 1) // block_size
    for bi in range(n_blocks):
        b = block_tables[s, bi]
        nk = min(block_size, n_keys - bi * block_size)
        for g in range(group):
            mx = m[g]
            for o in range(nk):
                sc = np.float32(0.0)
                for d in range(D):
                    sc += qs[g, d] * key_cache[b, o, kvh, d]
                scores[g, o] = sc
                if sc > mx:
                    mx = sc
            corr = math.exp(m[g] - mx)
            m[g] = mx
            lsum = l[g] * corr
            for d in range(D):
                acc[g, d] *= corr
            for o in range(nk):
                p = math.exp(scores[g, o] - mx)
                lsum += p
                for d in range(D):
                    acc[g, d] += p * value_cache[b, o, kvh, d]
            l[g] = lsum
    for g in range(group):
        inv = np.float32(1.0) / l[g]
        for d in range(D):
            out[t, h0 + g, d] = acc[g, d] * inv


@njit(cache=True)
def _token_seq(query_start_loc):
    S = query_start_loc.shape[0] - 1
    tok_seq = np.empty(query_start_loc[S], np.int64)
    for s in range(S):
        for t in range(query_start_loc[s], query_start_loc[s + 1]):
            tok_seq[t] = s
    return tok_seq


@njit(cache=True)
def _paged_attention_serial(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                            out):
    Hkv = key_cache.shape[2]
    tok_seq = _token_seq(query_start_loc)
    for item in range(tok_seq.shape[0] * Hkv):
        t = item // Hkv
        _attention_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
                        t, tok_seq[t], item - t * Hkv)


@njit(parallel=True, cache=True)
def _paged_attention_parallel(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                              out):
    Hkv = key_cache.shape[2]
    tok_seq = _token_seq(query_start_loc)
    for item in prange(tok_seq.shape[0] * Hkv):
        t = item // Hkv
        _attention_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, out,
                        t, tok_seq[t], item - t * Hkv)


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len=None, max_seq_len=None, out=None):
    """Causal attention of a flattened varlen batch over a paged KV cache (GQA aware).

    Same contract as ``reference.paged_attention``: ``q [T, num_heads, head_dim]`` float32,
    caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32, ``block_tables [S,
    max_blocks]``, ``seq_lens [S]``, ``query_start_loc [S+1]`` (int, converted to int32/int64),
    ``scale`` float. Returns ``[T, num_heads, head_dim]`` float32; rows at or past
    ``query_start_loc[S]`` are zero. Decode (one query per sequence) and prefill chunks (many
    queries after a cached context) go through the same kernel, parallel over (token, kv head).
    ``max_query_len`` and ``max_seq_len`` are accepted for signature compatibility with the CUDA
    table and unused. ``out``: an optional ``[T, num_heads, head_dim]`` float32 buffer (zeroed here).
    """
    if out is None:
        out = np.zeros(q.shape, dtype=_F32)
    else:
        out[...] = 0
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    query_start_loc = np.asarray(query_start_loc, dtype=np.int32)
    q_lens = np.diff(query_start_loc).astype(np.int64)
    # multiply-adds of QK^T and PV: sum over new tokens of their context, times heads x head_dim
    work = int(np.dot(q_lens, seq_lens.astype(np.int64) - (q_lens - 1) // 2)) * q.shape[1] * q.shape[2]
    parallel = work >= _PARALLEL_MIN_WORK and numba.get_num_threads() > 1
    kernel = _paged_attention_parallel if parallel else _paged_attention_serial
    kernel(np.asarray(q, dtype=_F32), key_cache, value_cache, np.asarray(block_tables, dtype=np.int32),
           seq_lens, query_start_loc, _F32(scale), out)
    return out


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


@njit(cache=True)
def _reshape_and_cache_kernel(key, value, key_cache, value_cache, slot_mapping):
    block_size = key_cache.shape[1]
    Hkv, D = key.shape[1], key.shape[2]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b = slot // block_size
        o = slot - b * block_size
        for h in range(Hkv):
            for d in range(D):
                key_cache[b, o, h, d] = key[t, h, d]
                value_cache[b, o, h, d] = value[t, h, d]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write this step's K/V ``[T, num_kv_heads, head_dim]`` into cache slots, in place.

    Same contract as ``reference.reshape_and_cache`` (slot -1 skipped). ``key``/``value`` may be
    strided views (e.g. slices of a fused QKV projection).
    """
    _reshape_and_cache_kernel(key, value, key_cache, value_cache,
                              np.asarray(slot_mapping, dtype=np.int64))


@njit(cache=True)
def _copy_blocks_kernel(cache, block_mapping):
    for i in range(block_mapping.shape[0]):
        cache[block_mapping[i, 1]] = cache[block_mapping[i, 0]]


def copy_blocks(key_caches, value_caches, block_mapping):
    """Copy whole blocks ``(src, dst)`` rows of ``block_mapping [N, 2]`` in every layer, in place.

    Rows are applied in order, as in ``reference.copy_blocks``.
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


# Each row kernel is a body over rows [t0, t1) plus a serial and a parallel driver; the wrapper
# picks the parallel one only when there is enough work to pay for waking the thread pool (a
# decode step's rows are tiny, and on a loaded machine a parallel region can wait a whole
# scheduler time slice for a descheduled worker).


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
def _rms_norm_parallel(x, weight, eps, out, n_chunks):
    T = x.shape[0]
    for c in prange(n_chunks):
        _rms_norm_rows(x, weight, eps, out, c * T // n_chunks, (c + 1) * T // n_chunks)


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
def _fused_add_rms_norm_parallel(x, residual, weight, eps, out, new_residual, n_chunks):
    T = x.shape[0]
    for c in prange(n_chunks):
        _fused_add_rms_norm_rows(x, residual, weight, eps, out, new_residual,
                                 c * T // n_chunks, (c + 1) * T // n_chunks)


def _n_chunks(n_elements: int, n_rows: int) -> int:
    """1 (run serially) for small work, else a few chunks per thread."""
    if n_elements < _PARALLEL_MIN_ELEMENTS or n_rows < 2 or numba.get_num_threads() < 2:
        return 1
    return min(n_rows, 4 * numba.get_num_threads())


def rms_norm(x, weight, eps, out=None):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x**2, -1) + eps) * weight``.

    ``x [T, hidden]`` float32, ``weight [hidden]`` float32; returns ``[T, hidden]`` float32 (into
    ``out`` when given).
    """
    out = np.empty(x.shape, dtype=_F32) if out is None else out
    n = _n_chunks(x.size, x.shape[0])
    if n == 1:
        _rms_norm_rows(x, weight, float(eps), out, 0, x.shape[0])
    else:
        _rms_norm_parallel(x, weight, float(eps), out, n)
    return out


def fused_add_rms_norm(x, residual, weight, eps, out=None, residual_out=None, rows=None):
    """Residual add then RMSNorm in one pass; returns ``(rms_norm(x + residual), x + residual)``.

    ``x, residual [T, hidden]`` float32. ``out`` / ``residual_out``: optional output buffers
    (``residual_out`` may be ``residual``). With ``rows`` (``[R]`` int64) only those rows are
    normalised and ``(out [R, hidden], None)`` is returned (the final norm before ``lm_head``).
    """
    if rows is not None:
        rows = np.asarray(rows, dtype=np.int64)
        normed, _ = fused_add_rms_norm(x[rows], residual[rows], weight, eps, out=out)
        return normed, None
    out = np.empty(x.shape, dtype=_F32) if out is None else out
    new_residual = np.empty(x.shape, dtype=_F32) if residual_out is None else residual_out
    n = _n_chunks(x.size, x.shape[0])
    if n == 1:
        _fused_add_rms_norm_rows(x, residual, weight, float(eps), out, new_residual, 0, x.shape[0])
    else:
        _fused_add_rms_norm_parallel(x, residual, weight, float(eps), out, new_residual, n)
    return out, new_residual


@njit(cache=True, fastmath=True)
def _rotary_rows(positions, x, cos_sin_cache, out, t0, t1):
    H, D = x.shape[1], x.shape[2]
    half = D // 2
    for t in range(t0, t1):
        p = positions[t]
        for h in range(H):
            for i in range(half):
                c = cos_sin_cache[p, i]
                s = cos_sin_cache[p, half + i]
                x1 = x[t, h, i]
                x2 = x[t, h, half + i]
                out[t, h, i] = x1 * c - x2 * s
                out[t, h, half + i] = x2 * c + x1 * s


@njit(parallel=True, cache=True)
def _rotary_parallel(positions, x, cos_sin_cache, out, n_chunks):
    T = x.shape[0]
    for c in prange(n_chunks):
        _rotary_rows(positions, x, cos_sin_cache, out, c * T // n_chunks, (c + 1) * T // n_chunks)


def rotary_embedding(positions, q, k, cos_sin_cache):
    """RoPE (Su et al. 2021) in the rotate-half layout; returns new ``(q_rot, k_rot)`` float32.

    ``positions [T]`` int64, ``q [T, num_heads, head_dim]``, ``k [T, num_kv_heads, head_dim]``
    (strided views allowed), ``cos_sin_cache [max_position, head_dim]`` from
    ``reference.rope_cos_sin_cache``. Outputs are contiguous.
    """
    pos = np.asarray(positions, dtype=np.int64)
    T = q.shape[0]
    outs = []
    for x in (q, k):
        out = np.empty(x.shape, dtype=_F32)
        n = _n_chunks(x.size, T)
        if n == 1:
            _rotary_rows(pos, x, cos_sin_cache, out, 0, T)
        else:
            _rotary_parallel(pos, x, cos_sin_cache, out, n)
        outs.append(out)
    return outs[0], outs[1]


@njit(cache=True, fastmath=True)
def _silu_and_mul_rows(x, out, t0, t1):
    inter = out.shape[1]
    for t in range(t0, t1):
        for i in range(inter):
            g = x[t, i]
            out[t, i] = g / (np.float32(1.0) + math.exp(-g)) * x[t, inter + i]


@njit(parallel=True, cache=True)
def _silu_and_mul_parallel(x, out, n_chunks):
    T = x.shape[0]
    for c in prange(n_chunks):
        _silu_and_mul_rows(x, out, c * T // n_chunks, (c + 1) * T // n_chunks)


def silu_and_mul(x, out=None):
    """SwiGLU activation (Shazeer 2020): ``silu(x[:, :I]) * x[:, I:]`` for ``x [T, 2I]`` float32
    (into ``out`` when given)."""
    T = x.shape[0]
    out = np.empty((T, x.shape[1] // 2), dtype=_F32) if out is None else out
    n = _n_chunks(x.size, T)
    if n == 1:
        _silu_and_mul_rows(x, out, 0, T)
    else:
        _silu_and_mul_parallel(x, out, n)
    return out


# ----------------------------------------------------------------------------------------------
# dense ops (NumPy BLAS)
# ----------------------------------------------------------------------------------------------


def prepare_weight(w):
    """A weight as the CPU table stores it: a C-contiguous float32 copy of ``w`` (``[out, in]`` or
    ``[n]``). Linear weights stay ``[out, in]``: the decode kernel then streams contiguous rows and
    BLAS takes ``W.T`` as a transpose flag (a pre-transposed copy measured no faster for prefill)."""
    return np.ascontiguousarray(w, dtype=_F32)


@njit(cache=True, fastmath=True)
def _linear_rows(x, weight, out, r0, r1):
    # out[:, r0:r1] = x @ weight[r0:r1].T; each weight row is read once for all T tokens.
    # float64 accumulation: free in a memory-bound step, and it keeps decode logits within
    # float32 rounding of the (blocked sgemm) prefill logits of the same tokens
    T, K = x.shape
    for r in range(r0, r1):
        for t in range(T):
            acc = 0.0
            for k in range(K):
                acc += np.float64(x[t, k]) * np.float64(weight[r, k])
            out[t, r] = acc


@njit(parallel=True, cache=True)
def _linear_parallel(x, weight, out, n_chunks):
    R = weight.shape[0]
    for c in prange(n_chunks):
        _linear_rows(x, weight, out, c * R // n_chunks, (c + 1) * R // n_chunks)


def linear(x, weight, out=None):
    """``x [T, in]`` float32 @ ``weight [out, in]``.T -> ``[T, out]`` float32 (into ``out`` when given).

    Few rows (decode steps, ``T <= 4``): a Numba matrix-vector kernel that streams each weight row once
    (the step is bound by reading the weights from memory); more rows: NumPy's BLAS sgemm.
    """
    T = x.shape[0]
    if T > _GEMV_MAX_ROWS:
        return np.matmul(x, weight.T, out=out)
    out = np.empty((T, weight.shape[0]), dtype=_F32) if out is None else out
    x = np.ascontiguousarray(x, dtype=_F32)
    n = _n_chunks(weight.size, weight.shape[0])
    if n == 1:
        _linear_rows(x, weight, out, 0, weight.shape[0])
    else:
        _linear_parallel(x, weight, out, n)
    return out


def embedding(ids, table, out=None):
    """Rows of ``table [vocab, hidden]`` for ``ids [T]`` int64 -> ``[T, hidden]`` float32 (into
    ``out`` when given).

    Raises:
        IndexError: an id outside ``[0, vocab)``.
    """
    return np.take(table, np.asarray(ids, dtype=np.int64), axis=0, out=out)


def rope_and_cache(positions, qkv, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads,
                   num_kv_heads, out=None):
    """``reference.rope_and_cache``: RoPE on the q / k slices of the fused projection ``qkv [T,
    (H + 2 Hkv) * D]``, rotated keys and values appended to the cache; returns the rotated queries
    ``[T, H, D]`` float32 (into ``out`` when given)."""
    T = qkv.shape[0]
    D = cos_sin_cache.shape[1]
    qd, kvd = num_heads * D, num_kv_heads * D
    q_rot, k_rot = rotary_embedding(positions, qkv[:, :qd].reshape(T, num_heads, D),
                                    qkv[:, qd:qd + kvd].reshape(T, num_kv_heads, D), cos_sin_cache)
    reshape_and_cache(k_rot, qkv[:, qd + kvd:qd + 2 * kvd].reshape(T, num_kv_heads, D), key_cache,
                      value_cache, slot_mapping)
    if out is None:
        return q_rot
    out[...] = q_rot
    return out


CPU_KERNELS = SimpleNamespace(
    xp=np,
    name="cpu",
    kv_cache_dtype=np.dtype(np.float32),
    act_dtype=np.dtype(np.float32),
    matmul_input_dtype=np.dtype(np.float32),
    paged_attention=paged_attention,
    reshape_and_cache=reshape_and_cache,
    copy_blocks=copy_blocks,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    rope_inv_freq=reference.rope_inv_freq,
    rope_cos_sin_cache=reference.rope_cos_sin_cache,
    rotary_embedding=rotary_embedding,
    rope_and_cache=rope_and_cache,
    silu_and_mul=silu_and_mul,
    linear=linear,
    embedding=embedding,
    prepare_weight=prepare_weight,
)
"""The CPU kernel table (see kernels/__init__.py ``get_kernels``)."""
