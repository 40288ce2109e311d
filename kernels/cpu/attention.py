"""Paged attention on the CPU: GQA groups and query tiles against whole KV blocks, online softmax.

The work of one step is cut into items ``(sequence, kv head, query tile)``. An item's rows are
every query row that reads that KV head: ``tile tokens x group`` (the GQA group, ``num_heads //
num_kv_heads`` query heads per KV head), so each key and value row is read once per item for the
whole group. The item walks the sequence's context in whole KV blocks (a chunk of ``CHUNK_KEYS``
keys at a time for tiles, one block for decodes) and keeps, per row, the running maximum ``m``,
the running sum ``l`` and the unnormalised output ``acc`` of the online softmax (rescaled by
``2^(m_old - m_new)`` when the maximum grows), then writes ``acc / l``. Rows stop at their causal
limit (key positions ``<= their own``); chunks past the last row's limit are never read.

Two ways to compute an item, chosen by its number of rows:

* **Tiles** (``rows >= TILE_MIN_ROWS``: prefill chunks), in explicit vector code
  (``kernels.cpu.simd``) where ``head_dim`` and the chunk are multiples of the vector width:
  per chunk of ``CHUNK_KEYS`` keys, the keys transposed into ``[head_dim, chunk]`` (``W x W``
  blocks in registers), then ``S = Q K^T`` as broadcast FMAs, ``TILE_RB`` rows x 4 vectors of
  keys in registers (keys outer, so their slice stays in L1 across the row blocks), each row block
  only up to the keys its last row sees (the diagonal chunk's masked triangle skipped), the
  online softmax per row in masked vectors, and ``acc += P V`` with the values read in place
  through their row offsets. Otherwise the chunk's keys and values are read in place when its
  blocks are consecutive in the cache (row stride ``num_kv_heads * head_dim``), else gathered
  into contiguous ``[chunk, head_dim]`` buffers, and ``S = Q K^T`` and ``acc += P V`` are two
  single-threaded BLAS ``sgemm`` calls; the softmax between them is a vectorised loop per row.
* **Decodes** (fewer rows: one token, or a few, times the ``group``): one KV block at a time,
  the scores of every row against the block's keys, each row's largest score, the
  online-softmax update, then the block's values. Where the block size is a multiple of 16
  and ``head_dim`` of the vector width, whole blocks go through explicit vector code
  (``kernels.cpu.simd``): each row against 16 keys in one pass with one transposed reduction
  for the 16 scores, their ``exp2`` weights in vectors, and ``P V`` with the row's output held
  in registers over the block's keys (LLVM's own vectorisation of these Numba loops ends each
  score in a horizontal reduction and runs the 16-key loops in their scalar remainders). The
  rows of one KV head (its GQA group) go together: their scores ``QK_ROWS`` rows at a time
  (``qk16_rows``, float32 caches) and their ``P V`` in one pass (``pv_rows``, up to
  ``PV_ROWS`` rows at a time), so each key and value vector is loaded once for the group instead of
  once per row; each sum is the row-by-row one, in the same order (the same bits). A
  sequence's last, partly filled block takes the plain loops for its scores and weights (other
  shapes for everything). The block's
  values are requested while its scores are computed and the next block's keys while its
  values are used, a share per row so the requests are spread over the block's work (the
  blocks of a sequence lie anywhere in the cache, so the hardware prefetcher cannot guess
  them; a whole block requested at once would overflow the 32 KiB L1 and evict the values
  before their use). The requests bring the lines into L2 (``threads.prefetch``): into L1 they
  would be bursts of dozens of lines, more than its miss buffers hold. With both cores reading,
  a decode item is bound by reading its K/V.
  When there are fewer decoding sequences than two per thread (a single long conversation) and
  at least ``SPLIT_MIN_THREADS`` threads, each is cut into key ranges of whole blocks, at least
  ``SPLIT_MIN_KEYS`` keys each (FlashDecoding): each range keeps its own running max, sum and
  unnormalised rows, merged after the region. A range still covers every KV
  head, so each thread reads whole key rows of its own blocks in memory order (a cut by KV head
  would read every third 256-byte slice of the rows).

**KV cache dtype.** The caches are float32, or 16-bit (``--kv-cache-dtype bfloat16``: bfloat16
bits as uint16, ``kernels/cpu/kv_dtype.py``): every read of a key or value widens it to float32
in registers (the vector code loads ``W`` 16-bit elements and widens them in two instructions;
the scalar loops convert per element), and all arithmetic stays float32. The sgemm tiles read
float32 only, so a 16-bit chunk is always gathered (widened) into the contiguous buffers. Numba
compiles one variant per cache dtype, when first called with it.

Scores are kept in base 2 (``q * scale * log2(e)``) and exponentiated with the vectorised
``kernels.cpu.math.exp2``: a scalar ``exp`` per score would cost as much as the two products. Items are
taken largest first from a shared counter by one task per thread (``kernels.cpu.threads``); every
buffer is per task and allocated before the parallel region. Planning is one compiled call and
buffers plus region another: each Python-level call costs tens of microseconds when a decode
step's weight stream has just evicted the interpreter's data from the caches.

Sources: PagedAttention (Kwon et al., SOSP 2023); online softmax (Milakov & Gimelshein 2018) as
used by FlashAttention (Dao et al., 2022); FlashDecoding's key partitions and GQA grouping
(Dao et al., 2023, "Flash-Decoding for long-context inference"); the CPU tiling of
vLLM's ``cpu_attn`` and llama.cpp's ``flash_attn_ext`` as descriptions of the problem.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .compile_jobs import NumbaJob
from .kv_dtype import KV_CACHE_DTYPES, is_float32, line_elems, to_f32
from .math import LOG2E, exp2
from .simd import PV_ROWS, QK_ROWS, TILE_RB, W as _W, exp2_sum16 as _exp2_sum16, pv_rows as _pv_rows
from .simd import qk16 as _qk16, qk16_rows as _qk16_rows
from .simd import row_exp2 as _row_exp2, row_max as _row_max, tile_pv as _tile_pv, tile_scores as _tile_scores
from .simd import transpose_rows as _transpose_rows
from .threads import NO_TRANS, ROW_MAJOR, TRANS, fetch_add, num_threads, prefetch, ptr, region_guard, sgemm

__all__ = ["paged_attention", "attention_items", "attention_item", "attention_scratch", "attention_into",
           "finish_attention", "plan"]

_F32 = np.float32
TILE_ROWS = 128        # target query rows (tokens x group) of a tile item
# Query rows per KV head from which an item is a tile; fewer take the loop path (decode)
TILE_MIN_ROWS = 12
CHUNK_KEYS = 128       # keys per online-softmax step (rounded down to whole blocks)
_PARALLEL_MIN_WORK = 1 << 18   # multiply-adds below which a step runs on the calling thread
SPLIT_MIN_KEYS = 128  # shortest key range of a partitioned decode (FlashDecoding)
# Fewest threads at which few decodes are split into key ranges
SPLIT_MIN_THREADS = 2
# Prefill tiles in explicit vector code (else two sgemm calls per chunk) where head_dim and the
# chunk are multiples of the lanes; with 8 lanes (AVX2) only up to head_dim 64
TILE_VECTOR = True
_SCORE_KEYS = 64       # keys per pass of a tile's scores over its row blocks
_NEG = _F32(-1e30)     # "minus infinity" of the running maximum (finite: fastmath assumes no inf)


@njit(cache=True, fastmath=True)
def _softmax_row(sc, r, j0, nv, n, m, l, acc):
    # online-softmax update of row r with the scores sc[r, j0:nv] (keys nv..n are past the row's
    # causal limit): weights 2^(s - max) in place (0 for masked keys), the running max m and sum
    # l updated, acc rescaled by 2^(m_old - m_new) when the max grows
    if nv <= j0:
        sc[r, j0:n] = 0.0
        return
    w = sc[r, j0:nv]       # a view from index 0: vectorised (see _softmax_update)
    mx = m[r]
    for j in range(w.shape[0]):
        mx = max(mx, w[j])
    sc[r, nv:n] = 0.0
    _softmax_update(sc, r, j0, nv, mx, m, l, acc)


@njit(inline="always", fastmath=True)
def _softmax_update(sc, r, j0, nv, mx, m, l, acc):
    # row r's running max m grows to mx (at least the max of its scores sc[r, j0:nv]): its sum l
    # and unnormalised row acc are rescaled by 2^(m_old - mx), then the weights 2^(s - mx)
    # replace the scores in place and are added to l
    if mx > m[r]:
        corr = _F32(2.0 ** (m[r] - mx))
        l[r] *= corr
        for d in range(acc.shape[1]):
            acc[r, d] *= corr
        m[r] = mx
    # over a view that starts at index 0: with a loop index that may be negative (j0 is not
    # known to be >= 0) Numba's negative-index wraparound makes every store a select of two
    # addresses, and LLVM then left the exponentials scalar (9 per key, a third of a decode
    # item's time)
    w = sc[r, j0:nv]
    total = _F32(0.0)
    for j in range(w.shape[0]):
        v = exp2(w[j] - mx)
        w[j] = v
        total += v
    l[r] += total


@njit(cache=True, fastmath=True)
def _softmax_step(sc, R, Rh, nk, c0, first_pos, group, m, l, acc):
    # one chunk of keys c0..c0+nk for rows 0..R of an item, whose row r is query token
    # (r % Rh) // group of the item (causal: the row sees keys <= its position)
    for r in range(R):
        _softmax_row(sc, r, 0, min(nk, first_pos + (r % Rh) // group + 1 - c0), nk, m, l, acc)


@njit(inline="always")
def _row_head_token(r, h0, t0, Rh, group):
    # (query head, token) of row r of an item: r = (h - h0) * Rh + (t - t0) * group + g
    return (h0 + r // Rh) * group + r % group, t0 + (r % Rh) // group


@njit(cache=True, fastmath=True)
def _init_rows(q, qscale, seq_lens, query_start_loc, s, h0, h1, t0, t1, group, qs, acc, m, l):
    # the item's query rows r = (h - h0) * Rh + (t - t0) * group + g, Rh = (t1 - t0) * group
    # (query head h * group + g of token t), scaled; empty accumulators. Returns the position of
    # token t0 in sequence s (it sees keys 0 .. that position).
    D = q.shape[2]
    Rh = (t1 - t0) * group
    for r in range(Rh * (h1 - h0)):
        hq, t = _row_head_token(r, h0, t0, Rh, group)
        for d in range(D):
            qs[r, d] = q[t, hq, d] * qscale
            acc[r, d] = 0.0
        m[r] = _NEG
        l[r] = 0.0
    return seq_lens[s] - (query_start_loc[s + 1] - query_start_loc[s]) + (t0 - query_start_loc[s])


@njit(cache=True, fastmath=True, error_model="numpy")
def _write_rows(h0, h1, t0, t1, group, acc, l, out):
    # out = acc / l for the rows of _init_rows
    D = out.shape[2]
    Rh = (t1 - t0) * group
    for r in range(Rh * (h1 - h0)):
        hq, t = _row_head_token(r, h0, t0, Rh, group)
        inv = _F32(1.0) / l[r]
        for d in range(D):
            out[t, hq, d] = acc[r, d] * inv


@njit(inline="always")
def _prefetch_row(cache, start, n):
    # request the cache lines of cache's flat elements start .. start + n (one per 64 bytes: 16
    # float32, 32 elements of a 16-bit cache)
    for x in range(0, n, line_elems(cache)):
        prefetch(cache, start + x)


@njit(cache=True, fastmath=True, error_model="numpy")
def _decode_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out,
                 s, h0, h1, t0, t1, k0, k1, part, qs, sc, acc, m, l, bm, pm, pl, pacc):
    # Tokens t0..t1 (fewer than TILE_MIN_ROWS rows per KV head: a decode) of sequence s, KV heads
    # h0..h1, keys k0..k1 of the context. Rows r = (h - h0) * Rh + (t - t0) * group + g. One KV
    # block at a time: scores of every row against the block's keys (bm: each row's largest),
    # the online-softmax update, then the block's values. The block's values are requested while
    # its scores are computed and the next block's keys while its values are used: at most two
    # half blocks in flight besides the one in use (the whole next block requested during the
    # scores would evict this block's values from L1 before their use).
    # part < 0: the normalised rows go to out; else (a key partition, FlashDecoding) the running
    # max, sum and unnormalised rows go to pm / pl / pacc[part] for _merge_partitions.
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = H // Hkv
    Rh = (t1 - t0) * group
    R = Rh * (h1 - h0)
    first_pos = _init_rows(q, qscale, seq_lens, query_start_loc, s, h0, h1, t0, t1, group, qs, acc, m, l)
    k1 = min(k1, first_pos + (t1 - t0))         # the last token sees keys 0 .. first_pos + t1 - t0 - 1
    row = Hkv * D
    b_end = (k1 + bs - 1) // bs
    fast = bs % 16 == 0 and D % _W == 0
    scw = sc.shape[1]
    for bi in range(k0 // bs, b_end):
        b = block_tables[s, bi]
        o0 = max(0, k0 - bi * bs)
        n = min(bs, k1 - bi * bs)
        if fast and o0 == 0 and n == bs:
            # a whole block: each row against 16 keys per call (simd.qk16), the block's values
            # requested a share of its keys before each KV head's rows
            nh = h1 - h0
            for hh in range(nh):
                for o in range(bs * hh // nh, bs * (hh + 1) // nh):
                    _prefetch_row(value_cache, (b * bs + o) * row + h0 * D, nh * D)
                for g0 in range(0, bs, 16):
                    k_at = (b * bs + g0) * row + (h0 + hh) * D
                    if is_float32(key_cache):
                        # the head's rows QK_ROWS at a time, each key vector loaded once for them
                        for r0 in range(0, Rh, QK_ROWS):
                            r = hh * Rh + r0
                            _qk16_rows(qs, r * D, D, min(QK_ROWS, Rh - r0), key_cache, k_at, row, D, sc, r * scw + g0,
                                       scw)
                    else:
                        # a 16-bit cache: row by row, one qk16 per query row
                        for rr in range(Rh):
                            r = hh * Rh + rr
                            _qk16(qs, r * D, key_cache, k_at, row, D, sc, r * scw + g0)
            for r in range(R):
                bm[r] = _row_max(sc, r * scw, bs, _NEG)
        else:
            for o in range(o0, n):
                _prefetch_row(value_cache, (b * bs + o) * row + h0 * D, (h1 - h0) * D)
                for hh in range(h1 - h0):
                    for rr in range(Rh):
                        r = hh * Rh + rr
                        a = _F32(0.0)
                        for d in range(D):
                            a += qs[r, d] * to_f32(key_cache[b, o, h0 + hh, d])
                        sc[r, o] = a
                        bm[r] = max(bm[r], a) if o > o0 else a
        for r in range(R):
            # keys of this block that row r sees (causal): o0 .. nv
            nv = min(n, first_pos + (r % Rh) // group + 1 - bi * bs)
            if fast and o0 == 0 and nv == bs:
                # _softmax_update with the weights of 16 keys at a time in vectors
                mx = max(m[r], bm[r])
                if mx > m[r]:
                    corr = _F32(2.0 ** (m[r] - mx))
                    l[r] *= corr
                    for d in range(D):
                        acc[r, d] *= corr
                    m[r] = mx
                total = _F32(0.0)
                for g0 in range(0, bs, 16):
                    total += _exp2_sum16(sc, r * scw + g0, mx)
                l[r] += total
            elif nv < n:
                _softmax_row(sc, r, o0, nv, n, m, l, acc)
            else:
                _softmax_update(sc, r, o0, n, max(m[r], bm[r]), m, l, acc)
        nxt = block_tables[s, bi + 1] if bi + 1 < b_end else b
        if fast:
            # each KV head's rows' P V over this block's keys, the values loaded once for
            # PV_ROWS of the head's rows (simd.pv_rows), the next block's keys requested a share
            # of them before each head
            nh = h1 - h0
            for hh in range(nh):
                for o in range(o0 + (n - o0) * hh // nh, o0 + (n - o0) * (hh + 1) // nh):
                    _prefetch_row(key_cache, (nxt * bs + o) * row + h0 * D, nh * D)
                voff = (b * bs + o0) * row + (h0 + hh) * D
                for r0 in range(0, Rh, PV_ROWS):
                    r = hh * Rh + r0
                    _pv_rows(sc, r * scw + o0, scw, min(PV_ROWS, Rh - r0), n - o0, value_cache, voff, row, D, acc,
                             r * D, D)
        else:
            for o in range(o0, n):
                _prefetch_row(key_cache, (nxt * bs + o) * row + h0 * D, (h1 - h0) * D)  # the next block's keys
                for hh in range(h1 - h0):
                    for rr in range(Rh):
                        r = hh * Rh + rr
                        p = sc[r, o]
                        for d in range(D):
                            acc[r, d] += p * to_f32(value_cache[b, o, h0 + hh, d])
    if part < 0:
        _write_rows(h0, h1, t0, t1, group, acc, l, out)
        return
    for r in range(R):
        pm[part, r] = m[r]
        pl[part, r] = l[r]
        for d in range(D):
            pacc[part, r, d] = acc[r, d]


@njit(cache=True)
def finish_attention(items, group, n_parts, pm, pl, pacc, query_start_loc, out):
    """After every item of a step has run: zero ``out``'s padding rows (past
    ``query_start_loc[-1]``; no item writes them) and merge the key partitions of split decodes
    (``_merge_partitions``) into their rows."""
    out[query_start_loc[-1]:] = 0
    if n_parts:
        _merge_partitions(items, group, pm, pl, pacc, out)


@njit(cache=True, fastmath=True, error_model="numpy")
def _merge_partitions(items, group, pm, pl, pacc, out):
    # FlashDecoding's reduction, online over the partitions: rows split over key ranges get
    # sum_p acc_p 2^(m_p - M) / sum_p l_p 2^(m_p - M), M = max_p m_p, into those rows of out
    # (which start from zero here: no item writes them)
    T, H, D = out.shape
    gm = np.full((T, H), _NEG, np.float32)
    gl = np.full((T, H), -1.0, np.float32)      # -1: row not seen yet
    for i in range(items.shape[0]):
        part = items[i, 7]
        if part < 0:
            continue
        Rh = (items[i, 4] - items[i, 3]) * group
        for r in range(Rh * (items[i, 2] - items[i, 1])):
            hq, t = _row_head_token(r, items[i, 1], items[i, 3], Rh, group)
            if gl[t, hq] < 0:
                gl[t, hq] = 0.0
                out[t, hq, :] = 0.0
            if pm[part, r] > gm[t, hq]:         # a larger max: rescale what is summed so far
                corr = exp2(gm[t, hq] - pm[part, r])
                gl[t, hq] *= corr
                for d in range(D):
                    out[t, hq, d] *= corr
                gm[t, hq] = pm[part, r]
            w = exp2(pm[part, r] - gm[t, hq])
            gl[t, hq] += pl[part, r] * w
            for d in range(D):
                out[t, hq, d] += pacc[part, r, d] * w
    for t in range(T):
        for hq in range(H):
            if gl[t, hq] > 0:
                inv = _F32(1.0) / gl[t, hq]
                for d in range(D):
                    out[t, hq, d] *= inv


@njit(cache=True, fastmath=True)
def _tile_chunks(key_cache, value_cache, block_tables, s, h0, R, n_keys, first_pos, group, qs, kb, ko, sc, acc, m,
                 l):
    # A tile's chunks of keys in explicit vector code (simd.tile_scores / tile_pv): per
    # chunk, its keys transposed into kb as [D, CH] (keys along the vectors) and the flat offsets
    # of its rows in ko (the values are read in place through them); then S for each block of
    # TILE_RB rows only up to the keys its last row sees (the causal triangle of the diagonal
    # chunk is skipped a row block at a time, where sgemm computed the whole rectangle), the
    # online softmax, and acc += P V over the same keys.
    D = qs.shape[1]
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    CH = kb.shape[0]
    kt = kb.reshape((D, CH))
    scw = sc.shape[1]
    for c0 in range(0, n_keys, CH):
        nk = min(CH, n_keys - c0)
        for j in range(nk):
            b = block_tables[s, (c0 + j) // bs]
            ko[j] = ((b * bs + (c0 + j) % bs) * Hkv + h0) * D
        full = nk // _W * _W
        _transpose_rows(key_cache, ko, full, D, kb, CH)
        for j in range(full, nk):
            b = block_tables[s, (c0 + j) // bs]
            for d in range(D):
                kt[d, j] = to_f32(key_cache[b, (c0 + j) % bs, h0, d])
        # the last vector's lanes past nk: never read as scores (the softmax masks them), zeroed
        # so that the products never meet uninitialised subnormals (slow on some cores)
        for j in range(nk, (nk + _W - 1) // _W * _W):
            for d in range(D):
                kt[d, j] = 0.0
        for g0 in range(0, nk, _SCORE_KEYS):       # keys outer: their [D, _SCORE_KEYS] slice stays in L1
            for r0 in range(0, R, TILE_RB):
                rb = min(TILE_RB, R - r0)
                seen = min(nk, first_pos + (r0 + rb - 1) // group + 1 - c0)   # keys of the block's last row
                if seen > g0:
                    nc = min(_SCORE_KEYS, (seen - g0 + _W - 1) // _W * _W)
                    _tile_scores(qs, r0 * D, D, rb, kb, g0, CH, nc, D, sc, r0 * scw + g0, scw)
        for r in range(R):
            # the online softmax of row r over the nv keys it sees: weights in place, 0 after them
            nv = min(nk, first_pos + r // group + 1 - c0)
            if nv <= 0:
                sc[r, :nk] = 0.0
                continue
            mx = _row_max(sc, r * scw, nv, m[r])
            if mx > m[r]:
                corr = _F32(2.0 ** (m[r] - mx))
                l[r] *= corr
                for d in range(D):
                    acc[r, d] *= corr
                m[r] = mx
            l[r] += _row_exp2(sc, r * scw, nv, nk, mx)
        for r0 in range(0, R, TILE_RB):
            rb = min(TILE_RB, R - r0)
            seen = min(nk, first_pos + (r0 + rb - 1) // group + 1 - c0)
            if seen > 0:
                _tile_pv(sc, r0 * scw, scw, rb, seen, value_cache, ko, D, acc, r0 * D, D)


@njit(cache=True, fastmath=True)
def _attend_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out,
                 s, h0, t0, t1, qs, kb, vb, ko, sc, acc, m, l):
    # Tokens t0..t1 (a prefill tile: at least TILE_MIN_ROWS rows) of sequence s, KV head h0. Row
    # r = (t - t0) * group + g: query head h0 * group + g of token t.
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = H // Hkv
    R = (t1 - t0) * group
    first_pos = _init_rows(q, qscale, seq_lens, query_start_loc, s, h0, h0 + 1, t0, t1, group, qs, acc, m, l)
    n_keys = first_pos + (t1 - t0)             # the last token sees keys 0 .. n_keys - 1
    CH = kb.shape[0]                            # whole blocks
    if TILE_VECTOR and D % _W == 0 and CH % _W == 0 and (_W == 16 or D <= 64):
        _tile_chunks(key_cache, value_cache, block_tables, s, h0, R, n_keys, first_pos, group, qs, kb, ko, sc, acc,
                     m, l)
        _write_rows(h0, h0 + 1, t0, t1, group, acc, l, out)
        return
    for c0 in range(0, n_keys, CH):
        nk = min(CH, n_keys - c0)
        # the chunk's keys and values as [nk, D] matrices: in place when its blocks are
        # consecutive in the cache (row stride Hkv * D), else gathered into kb / vb
        b0 = block_tables[s, c0 // bs]
        in_place = is_float32(key_cache)      # sgemm reads float32 only: a 16-bit cache is gathered
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
                    kb[j, d] = to_f32(key_cache[b, o, h0, d])
                    vb[j, d] = to_f32(value_cache[b, o, h0, d])
            kmat, vmat, ld = ptr(kb, 0), ptr(vb, 0), D
        sgemm(ROW_MAJOR, NO_TRANS, TRANS, R, nk, D, _F32(1.0), ptr(qs, 0), D, kmat, ld, _F32(0.0), ptr(sc, 0), CH)
        _softmax_step(sc, R, R, nk, c0, first_pos, group, m, l, acc)
        sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, R, D, nk, _F32(1.0), ptr(sc, 0), CH, vmat, ld, _F32(1.0), ptr(acc, 0), D)
    _write_rows(h0, h0 + 1, t0, t1, group, acc, l, out)


@njit(cache=True)
def attention_items(seq_lens, query_start_loc, num_kv_heads, group, tile_tokens, split, key_parts,
                    bs, min_keys):
    """Work items ``[n, 8]`` int64 ``(sequence, first kv head, end kv head, first token, end token,
    first key, end key, partition)``, largest first, and their total multiply-adds (QK^T and PV
    alike, causal).

    A sequence with fewer than ``TILE_MIN_ROWS`` query rows per KV head (a decode) is one item
    over every KV head, so that its blocks are read once, in memory order; with ``split``
    (too few decodes to feed the threads) its context is cut into up to ``key_parts`` key ranges
    of whole blocks (``bs`` keys), at least ``min_keys`` keys each (FlashDecoding), one item per
    range over every KV head, whose items carry partition numbers ``0, 1, ...`` (else -1).
    Longer ones are tile items of one KV head over the whole context, their tokens cut into
    the fewest tiles of at most ``tile_tokens`` tokens, of equal size (within one token)."""
    S = seq_lens.shape[0]
    n = 0
    for s in range(S):
        ql = query_start_loc[s + 1] - query_start_loc[s]
        if ql > 0:
            if ql * group < TILE_MIN_ROWS:
                parts = min(key_parts, max(1, seq_lens[s] // min_keys)) if split else 1
                n += parts
            else:
                n += num_kv_heads * ((ql + tile_tokens - 1) // tile_tokens)
    items = np.empty((n, 8), np.int64)
    cost = np.empty(n, np.int64)
    i = 0
    work = 0
    n_part = 0
    for s in range(S):
        q0, q1 = query_start_loc[s], query_start_loc[s + 1]
        ql = q1 - q0
        if ql == 0:
            continue
        loop = ql * group < TILE_MIN_ROWS
        # the fewest tiles of at most tile_tokens tokens, of equal size within one token (tiles of
        # exactly tile_tokens would leave a remainder item of its own: 128 tokens at GQA 3 are
        # 42 + 42 + 42 + 2, the last 2 on the decode path against every key)
        n_tiles = 1 if loop else (ql + tile_tokens - 1) // tile_tokens
        heads = num_kv_heads if loop else 1
        n_keys = seq_lens[s]
        parts = min(key_parts, max(1, n_keys // min_keys)) if loop and split else 1
        n_blocks = (n_keys + bs - 1) // bs
        for tile in range(n_tiles):
            t0 = q0 + ql * tile // n_tiles
            t1 = q0 + ql * (tile + 1) // n_tiles
            last_keys = seq_lens[s] - (q1 - t1)          # keys seen by the item's last token
            for j in range(parts):
                k0 = (n_blocks * j // parts) * bs
                k1 = min(n_keys, (n_blocks * (j + 1) // parts) * bs)
                span = min(k1, last_keys) - k0
                c = (t1 - t0) * group * heads * (span - ((t1 - t0) // 2 if j == parts - 1 else 0))
                for h in range(0, num_kv_heads, heads):
                    items[i, 0] = s
                    items[i, 1] = h
                    items[i, 2] = h + heads
                    items[i, 3] = t0
                    items[i, 4] = t1
                    items[i, 5] = k0
                    items[i, 6] = k1
                    items[i, 7] = -1
                    if parts > 1:
                        items[i, 7] = n_part
                        n_part += 1
                    cost[i] = c
                    work += c
                    i += 1
    order = np.argsort(-cost)
    return items[order], work


@njit(cache=True, inline="always")
def attention_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items, i,
                   qs, kb, vb, ko, sc, acc, m, l, bm, pm, pl, pacc):
    """Work item ``i`` of ``items`` (``attention_items``) into ``out``: a prefill tile when it has at
    least ``TILE_MIN_ROWS`` query rows per KV head, else a (possibly partitioned) decode. The
    buffers after ``i`` are the calling task's rows of ``attention_scratch``. A building block for
    fused regions (``forward.py``'s layer loop, the benchmark regions of ``perf/bench``). Inlined
    into its callers (``inline="always"``): compiled as a function of its own, it would be one
    more library that Numba optimizes and code-generates with both item kinds' whole call tree."""
    group = q.shape[1] // key_cache.shape[2]
    if (items[i, 4] - items[i, 3]) * group >= TILE_MIN_ROWS:
        _attend_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out,
                     items[i, 0], items[i, 1], items[i, 3], items[i, 4], qs, kb, vb, ko, sc, acc, m, l)
    else:
        _decode_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out,
                     items[i, 0], items[i, 1], items[i, 2], items[i, 3], items[i, 4], items[i, 5], items[i, 6],
                     items[i, 7], qs, sc, acc, m, l, bm, pm, pl, pacc)


@njit(cache=True)
def _plan(seq_lens, query_start_loc, num_heads, num_kv_heads, head_dim, bs, threads, min_work, min_keys,
          min_split_threads):
    """``(items, partitions, tasks)`` of one call: the work items (``attention_items``), how many
    carry a key partition, and 1 (the calling thread) or ``threads`` tasks."""
    group = num_heads // num_kv_heads
    work = 0                                    # multiply-adds of QK^T (PV the same again)
    n_decode = 0
    for s in range(seq_lens.shape[0]):
        ql = query_start_loc[s + 1] - query_start_loc[s]
        work += ql * (seq_lens[s] - (ql - 1) // 2)
        if 0 < ql and ql * group < TILE_MIN_ROWS:
            n_decode += 1
    parallel = threads > 1 and work * num_heads * head_dim >= min_work
    # fewer decoding sequences than 2 per thread (and enough threads, SPLIT_MIN_THREADS): split
    # them into key ranges, for about 4 items per thread
    split = parallel and n_decode < 2 * threads and threads >= min_split_threads
    key_parts = (4 * threads + max(1, n_decode) - 1) // max(1, n_decode) if split else 1
    items, _ = attention_items(seq_lens, query_start_loc, num_kv_heads, group, max(1, TILE_ROWS // group), split,
                               key_parts, bs, max(1, min_keys))
    n_parts = 0
    for i in range(items.shape[0]):
        if items[i, 7] >= 0:
            n_parts += 1
    return items, n_parts, threads if parallel and items.shape[0] > 1 else 1


@njit(cache=True)
def attention_scratch(tasks, num_heads, num_kv_heads, head_dim, bs, n_parts):
    """The per-task buffers ``attention_item`` takes (``qs, kb, vb, ko, sc, acc, m, l`` indexed by
    task) and the partial results of ``n_parts`` key partitions (``bm, pm, pl, pacc``), float32."""
    # per-task buffers (indexed by task, allocated before any parallel region) and the partial
    # results of partitioned decodes (fewer than TILE_MIN_ROWS rows per KV head, every KV head)
    group = num_heads // num_kv_heads
    rows = max(max(1, TILE_ROWS // group) * group, TILE_MIN_ROWS * num_kv_heads)
    chunk = max(1, CHUNK_KEYS // bs) * bs
    D = head_dim
    return (np.empty((tasks, rows, D), _F32), np.empty((tasks, chunk, D), _F32), np.empty((tasks, chunk, D), _F32),
            np.empty((tasks, chunk), np.int64),
            np.empty((tasks, rows, chunk), _F32), np.empty((tasks, rows, D), _F32), np.empty((tasks, rows), _F32),
            np.empty((tasks, rows), _F32), np.empty((tasks, rows), _F32),
            np.empty((n_parts, TILE_MIN_ROWS * num_kv_heads), _F32),
            np.empty((n_parts, TILE_MIN_ROWS * num_kv_heads), _F32),
            np.empty((n_parts, TILE_MIN_ROWS * num_kv_heads, D), _F32))


@njit(cache=True)
def _attention_serial(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items,
                      n_parts):
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    qs, kb, vb, ko, sc, acc, m, l, bm, pm, pl, pacc = attention_scratch(1, H, Hkv, D, bs, n_parts)
    for i in range(items.shape[0]):
        attention_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items, i,
                  qs[0], kb[0], vb[0], ko[0], sc[0], acc[0], m[0], l[0], bm[0], pm, pl, pacc)
    finish_attention(items, H // Hkv, n_parts, pm, pl, pacc, query_start_loc, out)


@njit(parallel=True, cache=True)
def _attention_parallel(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items,
                        n_parts, n_tasks):
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    qs, kb, vb, ko, sc, acc, m, l, bm, pm, pl, pacc = attention_scratch(n_tasks, H, Hkv, D, bs, n_parts)
    counter = np.zeros(1, np.int64)
    for w in prange(n_tasks):
        while True:
            i = fetch_add(counter, 1)
            if i >= items.shape[0]:
                break
            attention_item(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items, i,
                      qs[w], kb[w], vb[w], ko[w], sc[w], acc[w], m[w], l[w], bm[w], pm, pl, pacc)
    finish_attention(items, H // Hkv, n_parts, pm, pl, pacc, query_start_loc, out)


@njit(cache=True, nogil=True)
def attention_into(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items, n_parts,
                   tasks):
    """``paged_attention`` from compiled code, as planned by ``plan`` (``items``, ``n_parts``,
    ``tasks``): int64 ``block_tables``, ``seq_lens``, ``query_start_loc``; ``qscale`` the softmax
    scale times log2(e); ``out`` C-contiguous, its rows past ``query_start_loc[-1]`` zeroed here."""
    if items.shape[0] == 0:    # no query rows: every row is padding
        out[:] = 0
    elif tasks == 1:
        _attention_serial(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items,
                          n_parts)
    else:
        _attention_parallel(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, qscale, out, items,
                            n_parts, tasks)


def plan(seq_lens, query_start_loc, num_heads, num_kv_heads, head_dim, block_size, threads):
    """``(items, n_parts, tasks)`` of ``attention_into`` for one step's int64 ``seq_lens [S]`` and
    ``query_start_loc [S+1]`` (the same for every layer of the step) on ``threads`` threads."""
    return _plan(seq_lens, query_start_loc, num_heads, num_kv_heads, head_dim, block_size, threads,
                 _PARALLEL_MIN_WORK, SPLIT_MIN_KEYS, SPLIT_MIN_THREADS)


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len=None, max_seq_len=None, out=None):
    """Causal attention of a flattened varlen batch over a paged KV cache (GQA aware).

    Same contract as ``reference.paged_attention``: ``q [T, num_heads, head_dim]`` float32,
    caches ``[num_blocks, block_size, num_kv_heads, head_dim]`` float32 or 16-bit (bfloat16 bits as
    uint16, ``kernels/cpu/kv_dtype.py``: widened to float32 as they are read), C-contiguous, both
    of one dtype,
    ``block_tables [S, max_blocks]``, ``seq_lens [S]``, ``query_start_loc [S+1]`` (int, converted
    to int64), ``scale`` float. Returns ``[T, num_heads, head_dim]`` float32; rows at or past
    ``query_start_loc[S]`` are zero. Decodes and prefill chunks of one step go through one
    parallel region (see the module docstring). ``max_query_len`` and ``max_seq_len`` are
    accepted for signature compatibility with the CUDA table and unused. ``out``: an optional
    C-contiguous ``[T, num_heads, head_dim]`` float32 buffer for the result.

    Raises:
        ValueError: KV caches that are not C-contiguous, of another dtype, or of two dtypes (the
            kernels address blocks directly).
    """
    if not (key_cache.flags.c_contiguous and value_cache.flags.c_contiguous
            and key_cache.dtype in KV_CACHE_DTYPES.values() and value_cache.dtype == key_cache.dtype):
        raise ValueError("paged_attention needs C-contiguous KV caches of one dtype: float32, or bfloat16 bits "
                         f"as uint16 (got {key_cache.dtype} and {value_cache.dtype})")
    q = np.ascontiguousarray(q, dtype=_F32)
    T, H, D = q.shape
    bs, Hkv = key_cache.shape[1], key_cache.shape[2]
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    query_start_loc = np.asarray(query_start_loc, dtype=np.int64)
    block_tables = np.asarray(block_tables, dtype=np.int64)
    if out is None or not out.flags.c_contiguous:
        if out is not None:
            out[...] = paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)
            return out
        out = np.zeros((T, H, D), dtype=_F32)
    with region_guard():
        attention_into(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _F32(scale * LOG2E), out,
                       *plan(seq_lens, query_start_loc, H, Hkv, D, bs, num_threads()))
    return out

# ----------------------------------------------------------------------------------------------
# compiled ahead (compile_jobs.py; runtime/worker/precompile.py through the table)
# ----------------------------------------------------------------------------------------------

# the two kinds of item (attention_item, inlined into the layer loop's region): q, the caches, step
# metadata, scale, out; the item's fields; the task's scratch rows
_ATTEND_ITEM = "F3 F4 F4 I2 I1 I1 f32 F3  i64 i64 i64 i64  F2 F2 F2 I1 F2 F2 F1 F1"
_DECODE_ITEM = "F3 F4 F4 I2 I1 I1 f32 F3  i64 i64 i64 i64 i64 i64 i64 i64  F2 F2 F2 F1 F1 F1 F2 F2 F3"
PRECOMPILE = (
    NumbaJob(_decode_item, _DECODE_ITEM, "attention", 7.5, "paged attention: decode items"),
    NumbaJob(_attend_item, _ATTEND_ITEM, "attention", 6, "paged attention: prefill tiles"),
    NumbaJob(_plan, "I1 I1 i64 i64 i64 i64 i64 i64 i64 i64", "attention", 4, "paged attention: work plan"),
    NumbaJob(finish_attention, "I2 i64 i64 F2 F2 F3 I1 F3", "linear", 3.5, "paged attention: merge of key partitions"),
    NumbaJob(attention_scratch, "i64 i64 i64 i64 i64 i64", "linear", 1, "paged attention: scratch buffers"),
)
