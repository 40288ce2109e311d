"""Error bounds of the CUDA kernels against the float64 spec, derived from the arithmetic.

The CUDA table computes in float32 and rounds to bf16 inside the kernels that produce a matrix
product's input (see kernels/cuda/table.py). Against the float64 spec evaluated on the *same inputs*,
each output element can differ by (a) float32 rounding, bounded with Higham's gamma_n = n u / (1 -
n u), u = 2^-24, for an n-term sum in any order, with or without FMA (Higham, "Accuracy and
Stability of Numerical Algorithms", 2nd ed., sections 3.1-3.4), and (b) at most half a bf16 ulp,
2^-8 of the value, where the kernel rounds to bf16: the float32 value lies within (a) of the exact
one, so its rounding may land on either neighbour of a bf16 boundary, but never further. These
bounds hold whatever the summation order, so on any CPU (Intel AVX-512/AMX, AMD AVX2), under the
SIMT emulator and on a GPU.

Tensor-core products (mma.sync, cuBLAS bf16 GEMMs) multiply exactly but may align and truncate
inside each accumulation step instead of rounding: their sums get twice the float32 gamma. CUDA's
expf and rsqrtf are within 2 ulp (CUDA C Programming Guide, "Mathematical Functions", single
precision), i.e. 4 u relative.
"""

from __future__ import annotations

import numpy as np

U = 2.0 ** -24         # float32 unit roundoff
U_BF16 = 2.0 ** -8     # bf16 unit roundoff: half an ulp, relative
U64 = 2.0 ** -53       # float64 unit roundoff: the "exact" results and the bounds here are float64


def gamma(n) -> np.ndarray | float:
    n = np.asarray(n, dtype=np.float64)
    return n * U / (1 - n * U)


def gamma64(n) -> np.ndarray | float:
    """``gamma`` of float64: what evaluating an ``n``-operation expression here in float64 may
    add, relative to the magnitude of its terms."""
    n = np.asarray(n, dtype=np.float64)
    return n * U64 / (1 - n * U64)


def compose(rel) -> np.ndarray | float:
    """A first-order sum of relative errors (``k u`` for ``k`` roundings, ``4 u`` for a 2-ulp
    function, ...) made a bound: ``|prod (1 + d_i) - 1| <= rel / (1 - rel)`` when ``sum |d_i| <=
    rel < 1`` (Higham, lemma 3.1: the products of two or more ``d_i`` that the sum leaves out)."""
    rel = np.asarray(rel, dtype=np.float64)
    return rel / (1 - rel)


def bf16(x: np.ndarray) -> np.ndarray:
    """float -> the float32 value of its bf16 rounding (round to nearest even)."""
    from folio.kernels.cuda.table import bf16_bits_to_float32, float32_to_bf16_bits

    return bf16_bits_to_float32(float32_to_bf16_bits(np.asarray(x, dtype=np.float32)))


def rounded_bound(exact_abs, f32_err) -> np.ndarray:
    """Bound on |bf16(y32) - y| given |y| and |y32 - y| <= f32_err: the float32 error plus half a
    bf16 ulp of the float32 value."""
    return f32_err + U_BF16 * (exact_abs + f32_err)


def check(got, want, bound, what: str):
    """Assert |got - want| <= bound elementwise (bound from one of the functions here), with a
    message naming the worst element."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want)
    bad = ~(err <= bound)  # NaN fails too
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, err - bound, -np.inf)), err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.size} elements outside the bound; worst at "
                             f"{tuple(int(j) for j in i)}: got {got[i]!r}, want {want[i]!r}, bound {bound[i]!r}")


# ---- per operation: (float64 exact result, bound) ------------------------------------------------

def rms_norm(x, weight, eps, rounded=True):
    """y = x / sqrt(mean(x^2) + eps) * w. Float32: the sum of squares gamma_n, mean and +eps 2u,
    rsqrtf 4u (the square root halves the first three), two products 2u -> gamma_n / 2 + 7u of |y|,
    composed; plus this float64 evaluation of y (n + 5 operations on positive terms but x and w)."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    n = x.shape[-1]
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
    err = (compose(gamma(n) / 2 + 7 * U) + 2 * gamma64(n + 5)) * np.abs(y)
    return y, rounded_bound(np.abs(y), err)


def silu_and_mul(x, rounded=True):
    """silu(g) * u = g / (1 + exp(-g)) * u: expf 4u, add, divide, multiply 3u -> 8u of |y| (the
    relative error of 1 + e^-g is at most that of e^-g), composed; plus this float64 evaluation of
    y (4 operations, none a cancellation)."""
    x = np.asarray(x, dtype=np.float64)
    inter = x.shape[-1] // 2
    g, u = x[..., :inter], x[..., inter:]
    y = g / (1.0 + np.exp(-g)) * u
    err = (compose(8 * U) + 2 * gamma64(4)) * np.abs(y)
    return y, rounded_bound(np.abs(y), err)


def rope(positions, x, cos_sin_cache):
    """[x1 c - x2 s, x2 c + x1 s] with float32 c, s taken as exact inputs: two products and a sum,
    gamma_3 (|x1 c| + |x2 s|); plus this float64 evaluation of y and of the magnitude (3 operations
    each, relative to the magnitude)."""
    half = cos_sin_cache.shape[1] // 2
    c = cos_sin_cache[positions, :half].astype(np.float64)[:, None, :]
    s = cos_sin_cache[positions, half:].astype(np.float64)[:, None, :]
    x1, x2 = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
    y = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    mag = np.concatenate([np.abs(x1 * c) + np.abs(x2 * s), np.abs(x2 * c) + np.abs(x1 * s)], axis=-1)
    err = (gamma(3) + 2 * gamma64(3)) * mag
    return y, rounded_bound(np.abs(y), err)


def linear(x, w):
    """x @ w.T with bf16 inputs (exact products), float32 tensor-core accumulation: 2 gamma_K of
    sum |x w|; plus this float64 evaluation of x @ w.T and of sum |x w| (K terms each; bf16
    products are exact in float64)."""
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    K = x.shape[-1]
    return x @ w.T, (2 * gamma(K) + 2 * gamma64(K)) * (np.abs(x) @ np.abs(w).T)


def paged_attention(q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    rounded=True):
    """Causal paged attention (reference.paged_attention in float64) and its bound.

    Per row: scores s_j = scale q.k_j carry delta_j <= 2 gamma_D scale sum|q k_j| + u |s_j|
    (tensor-core accumulation; then the scaling). With delta = max_j delta_j, every probability
    p_j = exp(s_j - m) / l moves by a factor within exp(2 delta) (first order 2 delta), plus expf's
    4u and the float32 sums of l and of P V (gamma_n each); the prefill kernel also rounds p_j to
    bf16 for its P V product (2^-8). The decode kernel's online softmax multiplies a lane's sums
    by c = expf(m_old - m_new) at most once per two keys it reads and once per merge of lanes and
    warps (at most n / 2 + 6 times): the same c scales a key's term in P V and in l, so each
    rescaling's error (expf 4u, the product u) moves the keys' relative weights by at most 2 x 5u
    (10u (n / 2 + 6) in all). So |o - o_exact| <= (2.2 delta + 4u + 2 gamma_n + 2^-8 + 8u +
    10u (n / 2 + 6)) * A with A = sum_j p_j |v_j| (the 8u cover the normalisation and split-K's
    combination), plus half a bf16 ulp of the output.
    """
    T, H, D = q.shape
    block_size, Hkv = key_cache.shape[1], key_cache.shape[2]
    group = H // Hkv
    out = np.zeros((T, H, D))
    bound = np.zeros((T, H, D))
    for s in range(len(seq_lens)):
        start, end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len, ctx = end - start, int(seq_lens[s])
        if q_len == 0:
            continue
        idx = np.arange(ctx)
        blocks = block_tables[s, idx // block_size]
        k = key_cache[blocks, idx % block_size].astype(np.float64)
        v = value_cache[blocks, idx % block_size].astype(np.float64)
        for i in range(q_len):
            pos = ctx - q_len + i
            for h in range(H):
                kvh = h // group
                qv = q[start + i, h].astype(np.float64)
                kk, vv = k[: pos + 1, kvh], v[: pos + 1, kvh]
                sc = kk @ qv * scale
                delta = (2 * gamma(D) * scale * (np.abs(kk) @ np.abs(qv)) + U * np.abs(sc)).max()
                p = np.exp(sc - sc.max())
                p /= p.sum()
                o = p @ vv
                a = p @ np.abs(vv)
                n = pos + 1
                err = (2.2 * delta + 4 * U + 2 * gamma(n) + U_BF16 + 8 * U + 10 * U * (n / 2 + 6)) * a
                out[start + i, h] = o
                bound[start + i, h] = rounded_bound(np.abs(o), err) if rounded else err
    return out, bound


def gumbel_score_bound(scaled, noise) -> np.ndarray:
    """Bound on |score32 - score| for sample_kernel's plain-temperature path, score = x / T + G
    with G = -log(-log(u)) and u exact in both: the division rounds by u |x / T|; CUDA's logf is
    within 1 ulp (2 u relative; the emulator's std::log within half of that), so -logf(u) is within
    2 u of its value relative, which moves G by 2 u (1 + 3 u) absolute, and the outer logf adds
    2 u |G|; the addition rounds by u |x / T + G|. In all u (2 |x / T| + 3 |G| + 2.01) + O(u^2),
    bounded here by u (2 |x / T| + 3 |G| + 3)."""
    return U * (2 * np.abs(scaled) + 3 * np.abs(noise) + 3)


def check_gumbel_picks(got, logits, temperature, keys):
    """Each row's pick against kernels/reference.py's Gumbel-max in float64: a masked (-inf) token
    only when the whole row is masked (then V - 1), else a token whose score is within the two
    scores' bounds of the spec's best (a near tie may go either way, nothing else may)."""
    from folio.kernels import reference

    R, V = logits.shape
    want = reference.sample_gumbel(logits, temperature, keys)
    for r in range(R):
        x = logits[r].astype(np.float64)
        if np.isneginf(x).all():
            assert got[r] == V - 1, (r, got[r])
            continue
        g = reference.gumbel_noise(int(keys[r]), V)
        scaled = x / float(temperature[r])
        score = np.where(np.isneginf(x), -np.inf, scaled + g)
        e = gumbel_score_bound(np.where(np.isneginf(x), 0.0, scaled), g)
        k, j = int(got[r]), int(want[r])
        assert np.isfinite(score[k]), (r, k)
        assert score[k] + e[k] >= score[j] - e[j], (r, k, j, score[k], score[j])
