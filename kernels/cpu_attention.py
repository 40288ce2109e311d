"""Paged attention on the CPU: GQA groups and query tiles against whole KV blocks, online softmax.

The work of one step is cut into items ``(sequence, kv head, query tile)``. An item's rows are
every query row that reads that KV head: ``tile tokens x group`` (the GQA group, ``num_heads //
num_kv_heads`` query heads per KV head), so each key and value row is read once per item for
the whole group. The item walks the sequence's context a chunk of whole KV blocks at a time
(``CHUNK_KEYS`` keys) and keeps, per row, the running maximum ``m``, the running sum ``l`` and
the unnormalised output ``acc`` of the online softmax (rescaled by ``2^(m_old - m_new)`` when the
maximum grows), then writes ``acc / l``. Rows stop at their causal limit (key positions
``<= their own``); chunks past the last row's limit are never read.

Two ways to compute an item, chosen by its number of rows:

* **Tiles** (``rows >= TILE_MIN_ROWS``: prefill chunks): the chunk's keys and values are read
  in place when its blocks are consecutive in the cache (one matrix with row stride
  ``num_kv_heads * head_dim``), else gathered into contiguous ``[chunk, head_dim]`` buffers; then
  ``S = Q K^T`` and
  ``acc += P V`` are two single-threaded BLAS ``sgemm`` calls on ``[rows, head_dim] x [head_dim,
  chunk]`` and ``[rows, chunk] x [chunk, head_dim]`` (dense products at the sgemm rate); the
  softmax between them is a vectorised loop per row.
* **Loops** (decode: one token, ``group`` rows): the products are Numba loops over the cache
  rows in place (vectorised over ``head_dim``); a decode item is bound by reading its K/V.

Scores are kept in base 2 (``q * scale * log2(e)``) and exponentiated with the vectorised
``cpu_math.exp2``: a scalar ``exp`` per score would cost as much as the two products. Items are taken largest first from a shared
counter by one task per thread (``kernels.cpu_threads``); every buffer is per task and
allocated before the parallel region.

Sources: PagedAttention (Kwon et al., SOSP 2023); online softmax (Milakov & Gimelshein 2018) as
used by FlashAttention (Dao et al., 2022) and FlashDecoding's GQA grouping; the CPU tiling of
vLLM's ``cpu_attn`` and llama.cpp's ``flash_attn_ext`` as descriptions of the problem.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .cpu_math import LOG2E, exp2
from .cpu_threads import NO_TRANS, ROW_MAJOR, TRANS, fetch_add, num_threads, prefetch, ptr, sgemm

__all__ = ["paged_attention", "attention_items"]

_F32 = np.float32
TILE_ROWS = 128        # target query rows (tokens x group) of a tile item
TILE_MIN_ROWS = 8      # fewer rows: the loop path (decode)
CHUNK_KEYS = 128       # keys per online-softmax step (rounded down to whole blocks)
_PARALLEL_MIN_WORK = 1 << 18   # multiply-adds below which a step runs on the calling thread
_NEG = _F32(-1e30)     # "minus infinity" of the running maximum (finite: fastmath assumes no inf)


@njit(cache=True, fastmath=True)
def _exp2_row(sc, r, n, mx):
    # sc[r, :n] = 2^(sc[r, :n] - mx) in place, returns their sum
    total = _F32(0.0)
    for j in range(n):
        v = exp2(sc[r, j] - mx)
        sc[r, j] = v
        total += v
    return total


@njit(cache=True, fastmath=True)
def _softmax_step(sc, R, Rh, nk, c0, first_pos, group, m, l, acc):
    # one chunk of keys c0..c0+nk for rows 0..R of an item, whose row r is query token
    # (r % Rh) // group of the item: scores sc[r, :nk] -> weights (causal: the row sees keys
    # <= its position), update the running max m, sum l, and rescale acc when m grows
    D = acc.shape[1]
    for r in range(R):
        nv = min(nk, first_pos + (r % Rh) // group + 1 - c0)
        if nv <= 0:
            for j in range(nk):
                sc[r, j] = 0.0
            continue
        mx = m[r]
        for j in range(nv):
            mx = max(mx, sc[r, j])
        s = _exp2_row(sc, r, nv, mx)
        for j in range(nv, nk):
            sc[r, j] = 0.0
        if mx > m[r]:
            corr = _F32(2.0 ** (m[r] - mx))
            l[r] = l[r] * corr + s
            for d in range(D):
                acc[r, d] *= corr
            m[r] = mx
        else:
            l[r] += s


@njit(cache=True, fastmath=True)
def _scores_loop(qs, Rh, key_cache, b, h0, h1, n, sc, j0):
    # sc[(h - h0) * Rh + i, j0 + o] = qs[(h - h0) * Rh + i] . key_cache[b, o, h] for o < n, KV
    # heads h0..h1: the block is read in memory order (key, head), 4 keys per pass sharing each
    # q load
    D = key_cache.shape[3]
    o = 0
    while o + 4 <= n:
        for h in range(h0, h1):
            for r in range((h - h0) * Rh, (h - h0 + 1) * Rh):
                a0 = _F32(0.0)
                a1 = _F32(0.0)
                a2 = _F32(0.0)
                a3 = _F32(0.0)
                for d in range(D):
                    qv = qs[r, d]
                    a0 += qv * key_cache[b, o, h, d]
                    a1 += qv * key_cache[b, o + 1, h, d]
                    a2 += qv * key_cache[b, o + 2, h, d]
                    a3 += qv * key_cache[b, o + 3, h, d]
                sc[r, j0 + o] = a0
                sc[r, j0 + o + 1] = a1
                sc[r, j0 + o + 2] = a2
                sc[r, j0 + o + 3] = a3
        o += 4
    while o < n:
        for h in range(h0, h1):
            for r in range((h - h0) * Rh, (h - h0 + 1) * Rh):
                a0 = _F32(0.0)
                for d in range(D):
                    a0 += qs[r, d] * key_cache[b, o, h, d]
                sc[r, j0 + o] = a0
        o += 1


@njit(cache=True, fastmath=True)
def _values_loop(sc, Rh, value_cache, b, h0, h1, n, acc, j0):
    # acc[(h - h0) * Rh + i] += sum_o sc[(h - h0) * Rh + i, j0 + o] * value_cache[b, o, h]: 4
    # keys per pass, so each acc element is loaded and stored once per 4 keys
    D = value_cache.shape[3]
    o = 0
    while o + 4 <= n:
        for h in range(h0, h1):
            for r in range((h - h0) * Rh, (h - h0 + 1) * Rh):
                p0 = sc[r, j0 + o]
                p1 = sc[r, j0 + o + 1]
                p2 = sc[r, j0 + o + 2]
                p3 = sc[r, j0 + o + 3]
                for d in range(D):
                    acc[r, d] += (p0 * value_cache[b, o, h, d] + p1 * value_cache[b, o + 1, h, d]
                                  + p2 * value_cache[b, o + 2, h, d] + p3 * value_cache[b, o + 3, h, d])
        o += 4
    while o < n:
        for h in range(h0, h1):
            for r in range((h - h0) * Rh, (h - h0 + 1) * Rh):
                p0 = sc[r, j0 + o]
                for d in range(D):
                    acc[r, d] += p0 * value_cache[b, o, h, d]
        o += 1


@njit(cache=True)
def _prefetch_block(cache, b):
    # every cache line of block b of a [num_blocks, block_size, num_kv_heads, head_dim] cache
    n = cache.shape[1] * cache.shape[2] * cache.shape[3]
    base = b * n
    for i in range(0, n, 16):
        prefetch(cache, base + i)


@njit(cache=True, fastmath=True)
def _attend_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out,
                 s, h0, h1, t0, t1, qs, kb, vb, sc, acc, m, l):
    # Tokens t0..t1 of sequence s, KV heads h0..h1 (one for a tile item). Rows r = (h - h0) * Rh
    # + (t - t0) * group + g with Rh = (t1 - t0) * group: query head h * group + g of token t.
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = H // Hkv
    q_start = query_start_loc[s]
    first_pos = seq_lens[s] - (query_start_loc[s + 1] - q_start) + (t0 - q_start)
    Rh = (t1 - t0) * group
    tiles = Rh >= TILE_MIN_ROWS
    R = Rh * (h1 - h0)
    for r in range(R):
        hq = (h0 + r // Rh) * group + r % group
        t = t0 + (r % Rh) // group
        for d in range(D):
            qs[r, d] = q[t, hq, d] * qscale
            acc[r, d] = 0.0
        m[r] = _NEG
        l[r] = 0.0
    n_keys = first_pos + (t1 - t0)             # the last token sees keys 0 .. n_keys - 1
    n_blocks = (n_keys + bs - 1) // bs
    CH = kb.shape[0]                            # whole blocks
    for c0 in range(0, n_keys, CH):
        nk = min(CH, n_keys - c0)
        if tiles:
            # the chunk's keys and values as [nk, D] matrices: in place when its blocks are
            # consecutive in the cache (row stride Hkv * D), else gathered into kb / vb
            b0 = block_tables[s, c0 // bs]
            in_place = True
            for bi in range(c0 // bs + 1, (c0 + nk + bs - 1) // bs):
                if block_tables[s, bi] != b0 + bi - c0 // bs:
                    in_place = False
            if in_place:
                off = (b0 * bs * Hkv + h0) * D
                kmat, vmat, ld = ptr(key_cache, off), ptr(value_cache, off), Hkv * D
            else:
                for j in range(nk):
                    b = block_tables[s, (c0 + j) // bs]
                    o = (c0 + j) % bs
                    for d in range(D):
                        kb[j, d] = key_cache[b, o, h0, d]
                        vb[j, d] = value_cache[b, o, h0, d]
                kmat, vmat, ld = ptr(kb, 0), ptr(vb, 0), D
            sgemm(ROW_MAJOR, NO_TRANS, TRANS, R, nk, D, _F32(1.0), ptr(qs, 0), D, kmat, ld, _F32(0.0), ptr(sc, 0), CH)
        else:
            for j0 in range(0, nk, bs):
                # while this block's keys are used, ask for the next block's keys and this one's values
                bi = (c0 + j0) // bs
                if bi + 1 < n_blocks:
                    _prefetch_block(key_cache, block_tables[s, bi + 1])
                _prefetch_block(value_cache, block_tables[s, bi])
                _scores_loop(qs, Rh, key_cache, block_tables[s, bi], h0, h1, min(bs, nk - j0), sc, j0)
        _softmax_step(sc, R, Rh, nk, c0, first_pos, group, m, l, acc)
        if tiles:
            sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, R, D, nk, _F32(1.0), ptr(sc, 0), CH, vmat, ld, _F32(1.0), ptr(acc, 0),
                  D)
        else:
            for j0 in range(0, nk, bs):
                _values_loop(sc, Rh, value_cache, block_tables[s, (c0 + j0) // bs], h0, h1, min(bs, nk - j0), acc,
                             j0)
    for r in range(R):
        hq = (h0 + r // Rh) * group + r % group
        t = t0 + (r % Rh) // group
        inv = _F32(1.0) / l[r]
        for d in range(D):
            out[t, hq, d] = acc[r, d] * inv


@njit(cache=True)
def attention_items(seq_lens, query_start_loc, num_kv_heads, group, tile_tokens, split_heads):
    """Work items ``[n, 5]`` int64 ``(sequence, first kv head, end kv head, first token, end
    token)``, largest first, and their total multiply-adds (QK^T and PV alike, causal).

    A sequence with fewer than ``TILE_MIN_ROWS`` query rows per KV head (a decode) is one loop
    item over every KV head, so that its blocks are read once, in memory order, or with
    ``split_heads`` (too few decodes to feed the threads) one item per KV head. Longer ones are
    tile items of ``tile_tokens`` tokens and one KV head."""
    S = seq_lens.shape[0]
    n = 0
    for s in range(S):
        ql = query_start_loc[s + 1] - query_start_loc[s]
        if ql > 0:
            if ql * group < TILE_MIN_ROWS:
                n += num_kv_heads if split_heads else 1
            else:
                n += num_kv_heads * ((ql + tile_tokens - 1) // tile_tokens)
    items = np.empty((n, 5), np.int64)
    cost = np.empty(n, np.int64)
    i = 0
    work = 0
    for s in range(S):
        q0, q1 = query_start_loc[s], query_start_loc[s + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        loop = ql * group < TILE_MIN_ROWS
        step = ql if loop else tile_tokens
        heads = num_kv_heads if loop and not split_heads else 1
        for t0 in range(q0, q1, step):
            t1 = min(q1, t0 + step)
            last_keys = seq_lens[s] - (q1 - t1)          # keys seen by the item's last token
            c = (t1 - t0) * group * heads * (last_keys - (t1 - t0) // 2)
            for h in range(0, num_kv_heads, heads):
                items[i, 0] = s
                items[i, 1] = h
                items[i, 2] = h + heads
                items[i, 3] = t0
                items[i, 4] = t1
                cost[i] = c
                work += c
                i += 1
    order = np.argsort(-cost)
    return items[order], work


@njit(cache=True)
def _attention_serial(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items,
                      qs, kb, vb, sc, acc, m, l):
    for i in range(items.shape[0]):
        _attend_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out,
                     items[i, 0], items[i, 1], items[i, 2], items[i, 3], items[i, 4], qs[0], kb[0], vb[0], sc[0],
                     acc[0], m[0], l[0])


@njit(parallel=True, cache=True)
def _attention_parallel(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items,
                        qs, kb, vb, sc, acc, m, l, counter):
    n_tasks = qs.shape[0]
    for w in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= items.shape[0]:
                break
            _attend_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out,
                         items[i, 0], items[i, 1], items[i, 2], items[i, 3], items[i, 4], qs[w], kb[w], vb[w],
                         sc[w], acc[w], m[w], l[w])


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len=None, max_seq_len=None, out=None):
    """Causal attention of a flattened varlen batch over a paged KV cache (GQA aware).

    Same contract as ``reference.paged_attention``: ``q [T, num_heads, head_dim]`` float32,
    caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 (C-contiguous),
    ``block_tables [S, max_blocks]``, ``seq_lens [S]``, ``query_start_loc [S+1]`` (int, converted
    to int64), ``scale`` float. Returns ``[T, num_heads, head_dim]`` float32; rows at or past
    ``query_start_loc[S]`` are zero. Decodes and prefill chunks of one step go through one
    parallel region (see the module docstring). ``max_query_len`` and ``max_seq_len`` are
    accepted for signature compatibility with the CUDA table and unused. ``out``: an optional
    C-contiguous ``[T, num_heads, head_dim]`` float32 buffer for the result.

    Raises:
        ValueError: a KV cache that is not C-contiguous (the kernels address blocks directly).
    """
    if not (key_cache.flags.c_contiguous and value_cache.flags.c_contiguous):
        raise ValueError("paged_attention needs C-contiguous float32 KV caches")
    q = np.ascontiguousarray(q, dtype=_F32)
    T, H, D = q.shape
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = H // Hkv
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    block_tables = np.asarray(block_tables, dtype=np.int64)
    if out is None or not out.flags.c_contiguous:
        if out is not None:
            out[...] = paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
            return out
        out = np.zeros((T, H, D), dtype=_F32)
    else:
        out[int(query_start_loc[-1]):] = 0  # padding rows; every other row is written by its item
    tile_tokens = max(1, TILE_ROWS // group)
    q_lens = np.diff(query_start_loc)
    # multiply-adds of QK^T (the same again for PV): every new token against its context
    work = int(np.dot(q_lens, seq_lens - (q_lens - 1) // 2)) * H * D
    parallel = num_threads() > 1 and work >= _PARALLEL_MIN_WORK
    # fewer decoding sequences than 2 per thread: split them by KV head
    split = parallel and int(np.count_nonzero((q_lens > 0) & (q_lens * group < TILE_MIN_ROWS))) < 2 * num_threads()
    items, _ = attention_items(seq_lens, query_start_loc, Hkv, group, tile_tokens, split)
    if items.shape[0] == 0:
        return out
    rows = max(tile_tokens * group, TILE_MIN_ROWS * Hkv)
    chunk = max(1, CHUNK_KEYS // bs) * bs
    tasks = num_threads() if parallel and items.shape[0] > 1 else 1
    qs = np.empty((tasks, rows, D), _F32)
    acc = np.empty((tasks, rows, D), _F32)
    sc = np.empty((tasks, rows, chunk), _F32)
    kb = np.empty((tasks, chunk, D), _F32)
    vb = np.empty((tasks, chunk, D), _F32)
    m = np.empty((tasks, rows), _F32)
    l = np.empty((tasks, rows), _F32)
    args = (q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _F32(scale * LOG2E), out, items,
            qs, kb, vb, sc, acc, m, l)
    if tasks == 1:
        _attention_serial(*args)
    else:
        _attention_parallel(*args, np.zeros(1, np.int64))
    return out
