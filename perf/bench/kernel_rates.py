"""CPU kernel rates against this machine's limits, measured in one run (issue 9, items 3-4).

Limits, measured here with the same thread counts as the kernels:

* **copy bandwidth**: ``threads`` threads each ``np.copyto`` a slice of a 512 MiB float32 array
  (glibc ``memcpy``), bytes read + bytes written per second;
* **read bandwidth**: ``threads`` threads each take the BLAS ``sdot`` of slices of two 256 MiB
  float32 arrays (single-threaded BLAS), bytes read per second: the limit of a stream that only
  reads (weights in a decode step, the KV cache in decode attention). On the 2-vCPU EPYC this
  project measures on, one thread reads at ~15-19 GB/s and two at ~22-27 GB/s while a copy
  moves 19-23 / 30 GB/s counting both directions. It is a two-stream reader, not a ceiling:
  folio's decode product at T = 1 keeps 4 weight rows in flight and has read faster than it
  with one thread (up to 117% of it in one run), so a share above 100% means the limit lies higher;
* **sgemm**: NumPy's BLAS on its own thread pool (``threadpoolctl`` set to ``threads`` for the
  measurement), ``[T, K] x [K, N]`` float32.

Kernels (``folio.kernels.cpu``, Numba's pool set to ``threads``):

* **decode-sized products** (``T`` = 1..8 rows): the default model's four per-layer weights of
  every layer (30 x 14.2 MB, far beyond the last-level cache) streamed in turn; reported as GB/s
  of weights read against the copy bandwidth;
* **batched products** (``T`` = 64, 512, 2048 rows; the lm_head at 64): GFLOP/s against sgemm on
  the same shape and threads (at 64 rows folio runs its streaming kernel where the kernels are
  compiled with AVX-512, ``GEMV_MAX_ROWS``; above, the same kernel on streamed tiles where BLAS
  runs no AVX-512 kernels, ``STREAM_TILES``; otherwise its own sgemm tiles);
* **paged attention**, the default model's geometry (9 query heads, 3 KV heads, head_dim 64,
  blocks of 16, shuffled block tables): *decode* = 16 sequences of one new token each after
  ``ctx`` cached tokens, caches of enough layers to exceed four times the last-level cache,
  reported as GB/s of K/V read and as GFLOP/s, beside the *gather read* of the same caches: a
  Numba loop that only sums every K and V block of the same block tables in the same order on
  the same threads (what this access pattern alone gets from memory: blocks of 12 KiB
  scattered over the cache, not one stream); *prefill* = one sequence's whole ``ctx``-token
  prompt, GFLOP/s of the causal QK^T and PV (4 head_dim flops per (query row, key) pair)
  against sgemm on ``[ctx, 576] x [576, 3072]`` and against *sgemm at the tile's shapes*: each
  thread's own single-threaded BLAS calls ``[R, 64] x [64, C]`` and ``[R, C] x [C, 64]`` (a
  full tile's two products per chunk of keys, ``(R, C) = tile_shape()``; the inner dimensions
  64 and ``C`` are short for a packed GEMM), what BLAS reaches on a tile's own products (the
  sgemm tiles' building block; the vector tiles of ``kernels/cpu/simd.py`` replace those calls where they
  apply). Decode and prefill are timed as the forward pass calls them: ``attention_into`` per
  layer, the step's work items planned once (the forward plans once per step for all its
  layers); the planning is timed on its own.

**As the forward runs them, in one region** (2 threads or more): the forward pass runs a step's
products and attention inside one parallel region whose tasks meet at a counter after each
phase (``kernels/cpu/forward.py``), while the figures above call each kernel on its own, and each
call opens a region whose sleeping threads must be woken (``region_overhead_us``: ~15 us on the
Zen 3 VM, 57-73 us on a Zen 5 VM, where a thread woken late leaves a short product to its
partner). The ``*_region`` figures run the same work items the same way the forward does: the
30 layers' four decode-sized products (or ``_REGION_REPS`` calls of one batched product) as
phases of one region, and decode / prefill attention over every layer with its merge phase.

Every figure is the best of ``repeat`` timed calls after a warm-up (the machine's capability;
on a shared machine the median is printed too), with the load average beside it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit, prange

from folio.kernels.cpu import jit_cache
from folio.kernels.cpu.attention import attention_item, attention_scratch, finish_attention, plan
from folio.kernels.cpu.forward import wait_items_done
from folio.kernels.cpu.linear import linear_item, linear_items, linear_plan
from folio.kernels.cpu.math import LOG2E
from folio.kernels.cpu.threads import NO_TRANS, ROW_MAJOR, TRANS, atomic_add, ptr, sgemm

# the regions below link kernels of other files: their cache entries must follow those sources
jit_cache.cover(__file__)

_MODEL = dict(hidden=576, inter=1536, heads=9, kv_heads=3, head_dim=64, layers=30, vocab=49152)


def _timeit(fn, repeat: int) -> tuple[float, float]:
    """(best, median) wall seconds of ``fn()`` over ``repeat`` calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), float(np.median(ts))


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 32 MiB when unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            with open(os.path.join(base, d, "size")) as f:
                s = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
            best = max(best, int(s.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or (32 << 20)


def _sliced_best_s(threads: int, a, b, op, repeat: int) -> float:
    """Best wall seconds of ``threads`` threads each applying ``op(a_slice, b_slice)`` to their
    share of the two equal-sized arrays (one call per thread, all at once)."""
    cuts = np.linspace(0, a.size, threads + 1).astype(np.int64)
    with ThreadPoolExecutor(threads) as pool:
        def run():
            list(pool.map(lambda i: op(a[cuts[i]:cuts[i + 1]], b[cuts[i]:cuts[i + 1]]), range(threads)))
        best, _ = _timeit(run, repeat)
    return best


def copy_bandwidth_gbs(threads: int, n_bytes: int = 512 << 20, repeat: int = 5) -> float:
    """Best ``(read + write bytes) / s`` in GB/s (1e9) of ``threads`` threads copying slices."""
    a = np.ones(n_bytes // 4, dtype=np.float32)
    b = np.empty_like(a)
    return 2 * a.nbytes / _sliced_best_s(threads, b, a, np.copyto, repeat) / 1e9


def read_bandwidth_gbs(threads: int, n_bytes: int = 512 << 20, repeat: int = 5) -> float:
    """Best bytes read per second in GB/s (1e9) of ``threads`` threads each taking the BLAS
    ``sdot`` of their slices of two ``n_bytes / 2`` float32 arrays (BLAS held at one thread)."""
    from threadpoolctl import threadpool_limits
    a = np.ones(n_bytes // 8, dtype=np.float32)
    b = np.ones_like(a)
    with threadpool_limits(limits=1, user_api="blas"):
        return 2 * a.nbytes / _sliced_best_s(threads, a, b, np.dot, repeat) / 1e9


# After a call on several threads, OpenBLAS's own workers keep polling for more work before they
# sleep (its THREAD_TIMEOUT: 2^28 cycles by default, ~0.1 s), each holding a core: a Numba region
# timed in that window ran at its 1-thread rate (2 threads, T=64 products: 86-94 GFLOP/s right
# after the reference sgemm, 146-156 after a pause). Folio's own figures are taken after this.
_BLAS_SETTLE_S = 1.0


def sgemm_gflops(T: int, K: int, N: int, threads: int, repeat: int = 5) -> float:
    """NumPy's BLAS ``[T, K] @ [K, N]`` (weights stored ``[N, K]``) on ``threads`` BLAS threads.
    With ``threads > 1``, waits ``_BLAS_SETTLE_S`` afterwards until BLAS's workers sleep."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    with threadpool_limits(limits=threads, user_api="blas"):
        best, _ = _timeit(lambda: x @ w.T, repeat)
    if threads > 1:
        time.sleep(_BLAS_SETTLE_S)
    return 2 * T * K * N / best / 1e9


def region_overhead_us(threads: int, calls: int = 2000) -> dict:
    """Median and p99 wall microseconds of a parallel region with almost no work (one work item
    per thread), called back to back as a forward pass calls its kernels: the fixed cost of
    waking the pool and joining it, which every parallel kernel call pays."""
    from numba import njit, prange

    from folio.kernels.cpu.threads import fetch_add

    @njit(parallel=True)
    def region(a, n_tasks, counter):
        for _task in prange(n_tasks):
            while True:
                i = fetch_add(counter, 1)
                if i >= n_tasks:
                    break
                a[i] += 1.0

    _set_threads(threads)
    a = np.zeros(threads)
    region(a, threads, np.zeros(1, np.int64))
    ts = []
    for _ in range(calls):
        c = np.zeros(1, np.int64)
        t = time.perf_counter()
        region(a, threads, c)
        ts.append(time.perf_counter() - t)
    ts = np.array(ts) * 1e6
    return {"median_us": float(np.median(ts)), "mean_us": float(ts.mean()), "p99_us": float(np.percentile(ts, 99))}


_REGION_REPS = 8   # calls of one batched product inside one region (its "in one region" figure)


@njit(parallel=True, cache=True)
def _products_region(xs, stacks, ys, lin, reps, n_tasks):
    # reps rounds of the products xs[p] @ stacks[p][r % L].T -> ys[p] (tuples of one to four
    # kinds, planned by lin[p]) as phases of one region, the way kernels/cpu/forward.py's _layers_region
    # runs a step's products: items claimed from a counter per phase, every task waits at the
    # phase's end
    kinds = len(xs)
    L = stacks[0].shape[0]
    n_items = np.empty(kinds, np.int64)
    for p in range(kinds):
        n_items[p] = linear_items(xs[p].shape[0], stacks[p].shape[1], lin[p, 0], lin[p, 1], lin[p, 2])
    claims = np.zeros(reps * kinds, np.int64)
    done = np.zeros(reps * kinds, np.int64)
    for w in prange(n_tasks):
        for r in range(reps):
            for p in range(kinds):
                k = r * kinds + p
                while True:
                    i = atomic_add(claims, k, 1)
                    if i >= n_items[p]:
                        break
                    linear_item(xs[p], stacks[p][r % L], ys[p], lin[p, 0], lin[p, 1], lin[p, 2], i)
                    atomic_add(done, k, 1)
                wait_items_done(done, k, n_items[p])


def products_region_call(xs, stacks, threads: int, reps: int | None = None):
    """``(run, ys)``: ``run()`` computes ``ys[k] = xs[k] @ stacks[k][layer].T`` for every layer
    (``reps`` rounds, default one per layer; ``ys`` keeps the last round's) and every kind ``k``
    (1 to 4 of them) in one parallel region of ``threads`` tasks, as the forward does
    (``_products_region``). ``stacks``: C-contiguous float32 ``[L, N, K]``."""
    ys = tuple(np.empty((x.shape[0], w.shape[1]), np.float32) for x, w in zip(xs, stacks))
    lin = np.array([linear_plan(x.shape[0], w.shape[1:], threads) for x, w in zip(xs, stacks)], dtype=np.int64)
    args = (tuple(xs), tuple(stacks), ys, lin, reps or stacks[0].shape[0], threads)
    return (lambda: _products_region(*args)), ys


@njit(parallel=True, cache=True)
def _attention_region(q, key_caches, value_caches, block_tables, seq_lens, query_start_loc, qscale, out, items,
                      n_parts, n_tasks):
    # every layer's attention items, then its merge (one item), as phases of one region (as in
    # kernels/cpu/forward.py's _layers_region)
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = key_caches[0].shape[1], key_caches[0].shape[2]
    L = len(key_caches)
    qs, kb, vb, ko, sc, acc, m, l, bm, pm, pl, pacc = attention_scratch(n_tasks, H, Hkv, D, bs, n_parts)
    n_items = np.array([items.shape[0], 1], np.int64)
    claims = np.zeros(2 * L, np.int64)
    done = np.zeros(2 * L, np.int64)
    for w in prange(n_tasks):
        for layer in range(L):
            for p in range(2):
                k = 2 * layer + p
                while True:
                    i = atomic_add(claims, k, 1)
                    if i >= n_items[p]:
                        break
                    if p == 0:
                        attention_item(q, key_caches[layer], value_caches[layer], block_tables, seq_lens, query_start_loc,
                                  qscale, out, items, i, qs[w], kb[w], vb[w], ko[w], sc[w], acc[w], m[w], l[w], bm[w],
                                  pm, pl, pacc)
                    else:
                        finish_attention(items, H // Hkv, n_parts, pm, pl, pacc, query_start_loc, out)
                    atomic_add(done, k, 1)
                wait_items_done(done, k, n_items[p])


def attention_region_call(q, caches, block_tables, seq_lens, query_start_loc, threads):
    """``(run, out)``: like ``layers_call``, but every layer in one parallel region of ``threads``
    tasks, as the forward runs attention between the other phases of a step
    (``_attention_region``); ``out`` holds the last layer's result."""
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = caches[0][0].shape[1], caches[0][0].shape[2]
    out = np.zeros_like(q)
    items, n_parts, _ = plan(seq_lens, query_start_loc, H, Hkv, D, bs, threads)
    args = (q, tuple(k for k, _ in caches), tuple(v for _, v in caches), block_tables, seq_lens, query_start_loc,
            np.float32(D ** -0.5 * LOG2E), out, items, n_parts, threads)
    return (lambda: _attention_region(*args)), out


def _set_threads(threads: int) -> None:
    import numba
    numba.set_num_threads(threads)


def _model_weights(rng, layers: int) -> list:
    # the default model's four per-layer weights [qkv, o, gate_up, down], one [layers, N, K] stack each
    m = _MODEL
    H, Hkv, D, hid, inter = m["heads"], m["kv_heads"], m["head_dim"], m["hidden"], m["inter"]
    shapes = [((H + 2 * Hkv) * D, hid), (hid, H * D), (2 * inter, hid), (hid, inter)]
    return [rng.standard_normal((layers, *s), dtype=np.float32) * np.float32(0.02) for s in shapes]


def decode_products(threads: int, rows=(1, 2, 4, 8), repeat: int = 5, weights=None) -> list[dict]:
    """Decode-sized products streaming every layer's weights (``weights``: ``_model_weights``'s
    stacks): GB/s of weights read, GFLOP/s."""
    from folio.kernels.cpu.table import linear
    _set_threads(threads)
    stacks = weights or _model_weights(np.random.default_rng(0), _MODEL["layers"])
    nbytes = sum(st.nbytes for st in stacks)
    out = []
    for T in rows:
        xs = [np.random.default_rng(1).standard_normal((T, st.shape[2]), dtype=np.float32) for st in stacks]

        def run():
            for layer in range(stacks[0].shape[0]):
                for x, st in zip(xs, stacks):
                    linear(x, st[layer])
        best, med = _timeit(run, repeat)
        flops = 2 * T * nbytes / 4
        d = {"rows": T, "weight_bytes": nbytes, "gbs": nbytes / best / 1e9, "gbs_median": nbytes / med / 1e9,
             "gflops": flops / best / 1e9}
        if threads > 1:
            best, med = _timeit(products_region_call(xs, stacks, threads)[0], repeat)
            d.update(gbs_region=nbytes / best / 1e9, gbs_region_median=nbytes / med / 1e9)
        out.append(d)
    return out


def batched_products(threads: int, repeat: int = 5) -> list[dict]:
    """folio's products as ``linear_plan`` cuts them (the streaming kernel up to ``GEMV_MAX_ROWS``
    rows, T = 64 with AVX-512; above, its streamed tiles or sgemm tiles, ``STREAM_TILES``) against
    BLAS's own threading, same shapes and threads."""
    from folio.kernels.cpu.table import linear
    m = _MODEL
    H, Hkv, D, hid, inter = m["heads"], m["kv_heads"], m["head_dim"], m["hidden"], m["inter"]
    named = {"qkv_proj": ((H + 2 * Hkv) * D, hid), "o_proj": (hid, H * D), "gate_up_proj": (2 * inter, hid),
             "down_proj": (hid, inter)}
    cases = [(T, n, s) for T in (64, 512, 2048) for n, s in named.items()] + [(64, "lm_head", (m["vocab"], hid))]
    rng = np.random.default_rng(0)
    out = []
    for T, name, (N, K) in cases:
        w = rng.standard_normal((N, K), dtype=np.float32)
        x = rng.standard_normal((T, K), dtype=np.float32)
        _set_threads(threads)
        best, med = _timeit(lambda: linear(x, w), repeat)
        flops = 2 * T * K * N
        ref = sgemm_gflops(T, K, N, threads, repeat)
        d = {"rows": T, "name": name, "N": N, "K": K, "gflops": flops / best / 1e9,
             "gflops_median": flops / med / 1e9, "sgemm_gflops": ref}
        if threads > 1:
            best, med = _timeit(products_region_call([x], [w[None]], threads, reps=_REGION_REPS)[0], repeat)
            d.update(gflops_region=_REGION_REPS * flops / best / 1e9, gflops_region_median=_REGION_REPS * flops / med / 1e9)
        out.append(d)
    return out


def attention_case(rng, seqs, block_size=16, layers=1, heads=None, dtype=np.int32):
    """``(q, caches, block_tables, seq_lens, query_start_loc)`` for ``seqs`` = ``[(context, new
    tokens), ...]``: caches of ``layers`` layers holding every sequence's context (float32
    standard normal), shuffled block tables, index arrays of ``dtype``; ``heads`` = ``(query
    heads, KV heads, head_dim)``, the default model's when None."""
    H, Hkv, D = heads or (_MODEL["heads"], _MODEL["kv_heads"], _MODEL["head_dim"])
    nb = [(ctx + block_size - 1) // block_size for ctx, _ in seqs]
    total = sum(nb)
    ids = rng.permutation(total)
    tables = np.zeros((len(seqs), max(nb)), dtype)
    k = 0
    for s, n in enumerate(nb):
        tables[s, :n] = ids[k:k + n]
        k += n
    caches = [(rng.standard_normal((total, block_size, Hkv, D), dtype=np.float32),
               rng.standard_normal((total, block_size, Hkv, D), dtype=np.float32)) for _ in range(layers)]
    q_lens = [q for _, q in seqs]
    q = rng.standard_normal((sum(q_lens), H, D), dtype=np.float32)
    return q, caches, tables, np.array([c for c, _ in seqs], dtype), \
        np.concatenate([[0], np.cumsum(q_lens)]).astype(dtype)


@njit(parallel=True, cache=True, fastmath=True)
def _gather_read(key_cache, value_cache, block_tables, seq_lens, n_tasks):
    # sum of every K and V float of each sequence's blocks, block by block (keys, then values),
    # sequences taken in turn by n_tasks tasks: the reads of the decode attention, no arithmetic
    nb, row = key_cache.shape[0], key_cache.shape[1] * key_cache.shape[2] * key_cache.shape[3]
    kc, vc = key_cache.reshape(nb, row), value_cache.reshape(nb, row)
    bs = key_cache.shape[1]
    sums = np.zeros(n_tasks, np.float32)
    S = seq_lens.shape[0]
    for w in prange(n_tasks):
        a = np.float32(0.0)
        for s in range(w, S, n_tasks):
            for bi in range((seq_lens[s] + bs - 1) // bs):
                b = block_tables[s, bi]
                for x in range(row):
                    a += kc[b, x]
                for x in range(row):
                    a += vc[b, x]
        sums[w] = a
    return sums.sum()


@njit(cache=True, nogil=True)
def _tile_products(q, k, v, sc, acc, calls):
    # a prefill tile's two sgemm calls per chunk of keys, as kernels/cpu/attention.py's _attend_item makes
    # them: S = Q K^T, then acc += P V (P: the scores buffer), ``calls`` times
    R, D = q.shape
    nk = k.shape[0]
    for _ in range(calls):
        sgemm(ROW_MAJOR, NO_TRANS, TRANS, R, nk, D, np.float32(1.0), ptr(q, 0), D, ptr(k, 0), D,
              np.float32(0.0), ptr(sc, 0), nk)
        sgemm(ROW_MAJOR, NO_TRANS, NO_TRANS, R, D, nk, np.float32(1.0), ptr(sc, 0), nk, ptr(v, 0), D,
              np.float32(1.0), ptr(acc, 0), D)


def tile_shape(group: int = _MODEL["heads"] // _MODEL["kv_heads"]) -> tuple[int, int]:
    """``(rows, keys)`` of a full prefill tile's products in ``kernels/cpu/attention.py``: whole tokens of
    ``group`` query rows each, up to ``TILE_ROWS`` rows; ``CHUNK_KEYS`` keys per chunk."""
    from folio.kernels.cpu import attention as ca
    return max(1, ca.TILE_ROWS // group) * group, ca.CHUNK_KEYS


def sgemm_tile_gflops(threads: int, rows: int | None = None, keys: int | None = None, head_dim: int = 64,
                      calls: int = 200, repeat: int = 5) -> float:
    """GFLOP/s of ``threads`` Python threads each making ``calls`` pairs of the single-threaded
    BLAS calls that a prefill tile makes per chunk of keys (``[rows, head_dim] x [head_dim,
    keys]``, then ``[rows, keys] x [keys, head_dim]`` accumulated), on their own buffers;
    ``rows`` and ``keys`` default to the default model's full tile (``tile_shape``)."""
    full_rows, full_keys = tile_shape()
    rows, keys = rows or full_rows, keys or full_keys
    rng = np.random.default_rng(0)
    bufs = [(rng.standard_normal((rows, head_dim), dtype=np.float32),
             rng.standard_normal((keys, head_dim), dtype=np.float32),
             rng.standard_normal((keys, head_dim), dtype=np.float32),
             np.empty((rows, keys), np.float32), np.zeros((rows, head_dim), np.float32)) for _ in range(threads)]
    with ThreadPoolExecutor(threads) as pool:
        best, _ = _timeit(lambda: list(pool.map(lambda b: _tile_products(*b, calls), bufs)), repeat)
    return threads * calls * 4 * rows * keys * head_dim / best / 1e9


def layers_call(q, caches, block_tables, seq_lens, query_start_loc, threads, module=None, out=None):
    """A function running paged attention over every layer's caches as the forward pass calls it
    (``kernels/cpu/forward.py``): ``attention_into`` per layer into ``out`` (a new buffer when None), with
    the step's items planned once, here, outside the returned function (the forward plans once
    per step for all its layers; ``attention`` times the planning on its own). ``module``: the
    ``kernels/cpu/attention.py`` module to call (``perf/attention_ab.py`` passes another revision's)."""
    from folio.kernels.cpu import attention as cpu_attention
    mod = module or cpu_attention
    H, D = q.shape[1], q.shape[2]
    bs, Hkv = caches[0][0].shape[1], caches[0][0].shape[2]
    out = np.zeros_like(q) if out is None else out
    qscale = np.float32(D ** -0.5 * LOG2E)
    items = mod.plan(seq_lens, query_start_loc, H, Hkv, D, bs, threads)

    def run():
        for kc, vc in caches:
            mod.attention_into(q, kc, vc, block_tables, seq_lens, query_start_loc, qscale, out, *items)
    return run


def attention(threads: int, contexts=(128, 512, 2048), decode_seqs: int = 16, repeat: int = 5) -> list[dict]:
    """Decode and prefill attention rates at each context (see the module docstring)."""
    m = _MODEL
    H, Hkv, D = m["heads"], m["kv_heads"], m["head_dim"]
    rng = np.random.default_rng(0)
    llc = last_level_cache_bytes()
    tile = sgemm_tile_gflops(threads, repeat=repeat)   # one shape for every context: measured once
    out = []
    for ctx in contexts:
        # decode: many layers' caches in turn so that K/V come from memory
        kv_layer = decode_seqs * ctx * Hkv * D * 4 * 2
        layers = int(min(30, max(1, -(-4 * llc // kv_layer))))
        q, caches, bt, sl, qsl = attention_case(rng, [(ctx, 1)] * decode_seqs, layers=layers, dtype=np.int64)
        _set_threads(threads)

        best, med = _timeit(layers_call(q, caches, bt, sl, qsl, threads), repeat)
        gather, _ = _timeit(lambda: [_gather_read(kc, vc, bt, sl, threads) for kc, vc in caches], repeat)
        flops = layers * decode_seqs * H * ctx * 4 * D
        d = {"kind": "decode", "ctx": ctx, "seqs": decode_seqs, "layers": layers,
             "gflops": flops / best / 1e9, "gbs": layers * kv_layer / best / 1e9,
             "gbs_median": layers * kv_layer / med / 1e9, "gather_gbs": layers * kv_layer / gather / 1e9}
        if threads > 1:
            rb, rm = _timeit(attention_region_call(q, caches, bt, sl, qsl, threads)[0], repeat)
            d.update(gbs_region=layers * kv_layer / rb / 1e9, gbs_region_median=layers * kv_layer / rm / 1e9)
        out.append(d)
        # prefill: one whole prompt
        q, caches, bt, sl, qsl = attention_case(rng, [(ctx, ctx)], dtype=np.int64)   # int64 like the forward
        best, med = _timeit(layers_call(q, caches, bt, sl, qsl, threads), repeat)
        plan_s, _ = _timeit(lambda: plan(sl, qsl, H, Hkv, D, caches[0][0].shape[1], threads), repeat)
        flops = H * 4 * D * ctx * (ctx + 1) // 2
        ref = sgemm_gflops(ctx, m["hidden"], 2 * m["inter"], threads, repeat)
        d = {"kind": "prefill", "ctx": ctx, "seqs": 1, "gflops": flops / best / 1e9,
             "gflops_median": flops / med / 1e9, "sgemm_gflops": ref,
             "sgemm_tile_gflops": tile, "tile_shape": list(tile_shape(H // Hkv)), "plan_us": plan_s * 1e6}
        if threads > 1:
            # the prefill case has one layer's cache: the region runs it _REGION_REPS times
            rb, rm = _timeit(attention_region_call(q, caches * _REGION_REPS, bt, sl, qsl, threads)[0], repeat)
            d.update(gflops_region=_REGION_REPS * flops / rb / 1e9, gflops_region_median=_REGION_REPS * flops / rm / 1e9)
        out.append(d)
    return out


def model_decode(threads: int, model: str = "smollm2-135m-instruct", prompt_len: int = 300, tokens: int = 64,
                 repeat: int = 2) -> dict:
    """Single-sequence greedy decode of ``model`` (context prompt_len .. +tokens), tokens/s."""
    import pathlib
    import sys
    from folio.model.loader import load_model
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tests"))
    from support.greedy import greedy_generate   # the tests' single-sequence loop
    _set_threads(threads)
    net, config, _ = load_model(model, device="cpu")
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, config.vocab_size - 100, prompt_len)]
    greedy_generate(net, config, prompt[:20], max_tokens=3, ignore_eos=True)
    best = 0.0
    for _ in range(repeat):
        r = greedy_generate(net, config, prompt, max_tokens=tokens + 1, ignore_eos=True)
        best = max(best, r["decode_tokens_per_s"])
    seen, wbytes = set(), 0
    for a in [net.embed_tokens, net.lm_head, net.norm] + [v for layer in net.layers for v in vars(layer).values()]:
        if id(a) not in seen:
            seen.add(id(a))
            wbytes += a.nbytes
    return {"model": model, "prompt_len": prompt_len, "tokens": tokens, "decode_tokens_per_s": best,
            "weight_bytes": wbytes}


def run_kernel_rates(threads_list, repeat: int = 5, model: str | None = "smollm2-135m-instruct",
                     contexts=(128, 512, 2048), layers: int = 30) -> dict:
    """Every figure of this module for each thread count in ``threads_list`` (``layers``: how
    many layers' weights the decode-sized products stream; ``model`` None: no model decode)."""
    from folio.kernels.cpu.threads import blas_name
    from .common import command_line, machine_info
    out = {"command": command_line(), "machine": machine_info(), "blas": blas_name(),
           "omp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "NUMBA_THREADING_LAYER")},
           "last_level_cache_bytes": last_level_cache_bytes(), "runs": []}
    weights = _model_weights(np.random.default_rng(0), layers)
    for threads in threads_list:
        t0 = time.perf_counter()
        run = {"threads": threads, "load_start": os.getloadavg()[0],
               "region": region_overhead_us(threads),
               "copy_gbs": copy_bandwidth_gbs(threads, repeat=repeat),
               "read_gbs": read_bandwidth_gbs(threads, repeat=repeat),
               "decode_products": decode_products(threads, repeat=repeat, weights=weights),
               "batched_products": batched_products(threads, repeat=repeat),
               "attention": attention(threads, contexts=contexts, repeat=repeat)}
        if model:
            run["model_decode"] = model_decode(threads, model)
            run["model_decode"]["bound_tokens_per_s"] = run["copy_gbs"] * 1e9 / run["model_decode"]["weight_bytes"]
            run["model_decode"]["read_bound_tokens_per_s"] = run["read_gbs"] * 1e9 / run["model_decode"]["weight_bytes"]
        import numba
        out["threading_layer"] = numba.threading_layer()
        run["load_end"] = os.getloadavg()[0]
        run["seconds"] = time.perf_counter() - t0
        out["runs"].append(run)
    return out


def _tile_text(d: dict) -> str:
    if "tile_shape" not in d:
        return ""
    r, c = d["tile_shape"]
    return f" [{r}x64]x[64x{c}], [{r}x{c}]x[{c}x64]"


def format_kernel_rates(out: dict) -> str:
    """Human-readable lines of ``run_kernel_rates``'s result."""
    mi = out["machine"]
    L = [f"command: {out['command']}",
         f"machine: {mi.get('cpu', '?')}, {mi.get('cores')} cores, last-level cache "
         f"{out['last_level_cache_bytes'] >> 20} MiB; sgemm: {out['blas']}"
         + (f", {mi['blas_kernels']} kernels" if mi.get("blas_kernels") else ""),
         f"thread pool: Numba {out.get('threading_layer', '?')} layer, {out.get('omp_env')}"]
    for r in out["runs"]:
        t, bw, rb = r["threads"], r["copy_gbs"], r.get("read_gbs")
        rd = (lambda g: f" {100 * g / rb:4.0f}% of read") if rb else (lambda g: "")
        L += ["", f"== {t} thread(s): load {r['load_start']:.2f} -> {r['load_end']:.2f}, {r['seconds']:.0f} s; "
                  f"copy bandwidth {bw:.1f} GB/s (read + write)"
                  + (f", read bandwidth {rb:.1f} GB/s (sdot)" if rb else "") + "; an empty parallel region "
                  f"{r['region']['median_us']:.1f} us median, {r['region']['p99_us']:.1f} us p99"]
        L.append(f"decode-sized products ({r['decode_products'][0]['weight_bytes'] / 1e6:.0f} MB of weights streamed): rows, GB/s of weights (best / median), "
                 "% of copy bandwidth, % of read bandwidth, GFLOP/s"
                 + ("; in one region: every layer's products as phases of one region, as the forward runs them"
                    if t > 1 else ""))
        for d in r["decode_products"]:
            L.append(f"  T={d['rows']:<3d} {d['gbs']:6.1f} / {d['gbs_median']:5.1f} GB/s  {100 * d['gbs'] / bw:4.0f}%"
                     f"{rd(d['gbs'])}  {d['gflops']:6.1f} GFLOP/s"
                     + (f"; in one region {d['gbs_region']:5.1f} / {d['gbs_region_median']:5.1f} GB/s "
                        f"{100 * d['gbs_region'] / bw:4.0f}%{rd(d['gbs_region'])}" if "gbs_region" in d else ""))
        L.append("batched products: rows x name [N, K], folio GFLOP/s (best / median), BLAS sgemm GFLOP/s "
                 "(its own threads), folio / sgemm" + (f"; in one region: {_REGION_REPS} calls as phases of one "
                                                       "region, as the forward runs them" if t > 1 else ""))
        for d in r["batched_products"]:
            L.append(f"  T={d['rows']:<5d}{d['name']:<13}[{d['N']}, {d['K']}]  {d['gflops']:6.1f} / "
                     f"{d['gflops_median']:5.1f}  sgemm {d['sgemm_gflops']:6.1f}  {100 * d['gflops'] / d['sgemm_gflops']:4.0f}%"
                     + (f"; in one region {d['gflops_region']:6.1f} / {d['gflops_region_median']:5.1f}  "
                        f"{100 * d['gflops_region'] / d['sgemm_gflops']:4.0f}%" if "gflops_region" in d else ""))
        L.append("paged attention (9 heads / 3 KV heads, head_dim 64): decode = 16 seqs x 1 token, prefill = 1 whole "
                 "prompt")
        for d in r["attention"]:
            if d["kind"] == "decode":
                g = d.get("gather_gbs")
                L.append(f"  decode  ctx {d['ctx']:<5d} {d['gflops']:6.1f} GFLOP/s  K/V read {d['gbs']:5.1f} / "
                         f"{d['gbs_median']:5.1f} GB/s = {100 * d['gbs'] / bw:4.0f}% of copy{rd(d['gbs'])}"
                         + (f", gather read {g:5.1f} GB/s ({100 * d['gbs'] / g:3.0f}% of it)" if g else "")
                         + f" ({d['layers']} layers)"
                         + (f"; in one region {d['gbs_region']:5.1f} / {d['gbs_region_median']:5.1f} GB/s = "
                            f"{100 * d['gbs_region'] / bw:4.0f}% of copy{rd(d['gbs_region'])}"
                            + (f", {100 * d['gbs_region'] / g:3.0f}% of the gather read" if g else "")
                            if "gbs_region" in d else ""))
            else:
                tile = d.get("sgemm_tile_gflops")
                L.append(f"  prefill ctx {d['ctx']:<5d} {d['gflops']:6.1f} / {d['gflops_median']:5.1f} GFLOP/s  "
                         f"sgemm [{d['ctx']}x576]x[576x3072] {d['sgemm_gflops']:6.1f}  "
                         f"{100 * d['gflops'] / d['sgemm_gflops']:4.0f}%"
                         + (f"; sgemm at the tile's shapes{_tile_text(d)} {tile:6.1f}  {100 * d['gflops'] / tile:4.0f}%"
                            if tile else "")
                         + (f"; planning {d['plan_us']:.0f} us per step" if "plan_us" in d else "")
                         + (f"; in one region {d['gflops_region']:6.1f} / {d['gflops_region_median']:5.1f} GFLOP/s "
                            f"{100 * d['gflops_region'] / d['sgemm_gflops']:4.0f}% of sgemm" if "gflops_region" in d else ""))
        if "model_decode" in r:
            md = r["model_decode"]
            L.append(f"single-sequence decode of {md['model']} (context {md['prompt_len']}..+{md['tokens']}): "
                     f"{md['decode_tokens_per_s']:.1f} tokens/s; DRAM bound {md['weight_bytes'] / 1e6:.0f} MB/step "
                     f"at {bw:.1f} GB/s = {md['bound_tokens_per_s']:.1f} tokens/s; "
                     f"{100 * md['decode_tokens_per_s'] / md['bound_tokens_per_s']:.0f}% of it"
                     + (f"; at the read bandwidth {md['read_bound_tokens_per_s']:.1f} tokens/s, "
                        f"{100 * md['decode_tokens_per_s'] / md['read_bound_tokens_per_s']:.0f}% of it"
                        if "read_bound_tokens_per_s" in md else ""))
    return "\n".join(L)
