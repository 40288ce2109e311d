"""Error bounds of float32 arithmetic for the tests' tolerances, derived rather than measured.

A tolerance that only one machine's measurement supports fails on the next machine: BLAS
kernels sum in a different order on AVX2 and AVX-512/AMX, LLVM vectorises Numba loops with
a different number of lanes, and a sum rounded in another order lands on another float32. The
bounds here hold for *any* summation order:

* ``u = 2^-24``, the unit roundoff of float32; ``gamma(n) = n u / (1 - n u)`` bounds the relative
  error of ``n`` successive roundings (Higham, "Accuracy and Stability of Numerical
  Algorithms", 2nd ed., section 3.1), so a dot product of ``n`` terms in any order has
  ``|fl(x . y) - x . y| <= gamma(n) sum |x_i y_i|`` (Higham, eq. 3.5).
* Where a whole model's forward pass is compared (30 layers), a worst-case bound is useless;
  ``forward_logit_atol`` uses the probabilistic model of rounding (Higham & Mary, "A New Approach
  to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 2019): independent roundings
  grow like ``sqrt(n) u``, not ``n u``.
"""

from __future__ import annotations

import math

import numpy as np

U32 = 2.0 ** -24
"""Unit roundoff of float32 (half the distance from 1 to the next float32)."""


def gamma(n: int) -> float:
    """``n u / (1 - n u)``: the relative error bound of ``n`` float32 roundings in sequence."""
    return n * U32 / (1 - n * U32)


def dot_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Elementwise bound on ``|fl32(x @ w.T) - x @ w.T|`` for ``x [T, K]``, ``w [N, K]``, any
    summation order, the result rounded to float32 once more (``gamma(K + 1)``)."""
    K = x.shape[1]
    return gamma(K + 1) * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)


def exp2_rel_bound() -> float:
    """Relative error bound of ``kernels.cpu.math.exp2``: the Taylor remainder of ``e^(f ln 2)``
    after degree 7 for ``|f| <= 1/2`` plus 8 Horner steps (one float32 rounding each, partial
    results below 1.42), plus the rounding of ``x - round(x)``."""
    t = 0.5 * math.log(2.0)
    remainder = t ** 8 / math.factorial(8) * math.exp(t)
    return remainder + 8 * 1.42 * U32 + 2 * U32


def _query_rows(case: dict):
    """Per query row ``t`` and head ``h`` of a paged-attention case: ``(t, h, n, qk, vmax)``, with
    ``n`` the keys it attends to, ``qk = max_j sum_d |q_d k_jd|`` over them and ``vmax = max_j
    max_d |v_jd|`` (float64)."""
    q, kc, vc = case["q"], case["key_cache"], case["value_cache"]
    bt, sl, qsl = case["block_tables"], case["seq_lens"], case["query_start_loc"]
    H = q.shape[1]
    bs, Hkv = kc.shape[1], kc.shape[2]
    group = H // Hkv
    for s in range(len(sl)):
        start, end, ctx = int(qsl[s]), int(qsl[s + 1]), int(sl[s])
        if end == start:
            continue
        idx = np.arange(ctx)
        k = np.abs(kc[bt[s, idx // bs], idx % bs].astype(np.float64))  # [ctx, Hkv, D]
        v = np.abs(vc[bt[s, idx // bs], idx % bs].astype(np.float64))
        for i in range(end - start):
            n = ctx - (end - start) + i + 1
            for h in range(H):
                qk = float(np.max(k[:n, h // group] @ np.abs(q[start + i, h].astype(np.float64))))
                yield start + i, h, n, qk, float(np.max(v[:n, h // group]))


def attention_bound(case: dict) -> np.ndarray:
    """``[T, H, 1]`` bound on the error of one output row of paged attention against the exact
    result (``reference.paged_attention`` is float64, rounded once to float32), for any order
    of the sums, online or not.

    With ``s_j = scale q . k_j`` computed with error ``<= ds = gamma(D + 3) scale max_j sum_d
    |q_d k_jd|`` (D products, the scale and log2(e) folded into q, the max subtraction), each
    softmax weight ``e^(s_j - m)`` is off by a relative ``e^(2 ds) - 1`` plus the exp2 error, the
    sums over ``n`` keys (``l`` and every output coordinate) by ``gamma(n)``, and the online
    rescaling by one rounding per chunk of keys (at most ``n``). The output is a convex
    combination of value rows, so a relative error ``e`` of the weights moves it by at most
    ``2 e max_j |v_j|``.
    """
    D = case["q"].shape[2]
    out = np.zeros(case["q"].shape[:2] + (1,))
    for t, h, n, qk, vmax in _query_rows(case):
        ds = gamma(D + 3) * case["scale"] * qk
        weights = math.expm1(2 * ds) + exp2_rel_bound()
        rel = 2 * weights + 2 * gamma(n) + gamma(n) + 2 * U32
        out[t, h, 0] = rel * vmax
    return out


def forward_logit_atol(num_layers: int, max_dot_len: int, logits: np.ndarray, schedules: int = 2) -> float:
    """Bound on the logit difference between float32 forward passes that differ only in rounding
    (another summation order: chunked vs whole prefill, decode kernels vs sgemm, another machine's
    BLAS), or between one of them and the exact (float64) pass with ``schedules=1``.

    Each layer perturbs the residual stream by a relative rounding error of about ``sqrt(K) u``
    (its longest dot product has ``K = max_dot_len`` terms); independent across ``L`` layers the
    perturbations add like a random walk, ``sqrt(L K) u``; two schedules each carry their own
    (``sqrt(schedules)``). The largest logit's magnitude scales the error of every logit (each
    is a dot product of the last hidden state with a vocabulary row).

    The model assumes attention scores of order one, as in trained models (the default model:
    float32 vs float64 differ by 0.1 of this bound). Scores of order 100 (random weights scaled
    up) turn their absolute rounding error into a relative error of the softmax weights and
    exceed it; such tests need their own bound.
    """
    return math.sqrt(schedules * num_layers * max_dot_len) * U32 * float(np.abs(logits).max())


U_BF16 = 2.0 ** -8
"""Unit roundoff of bfloat16 (precision 8 bits, the implicit one included: ``u = 2^-p``, as float32's
``2^-24``): a float32 rounded to the nearest bfloat16 is within a relative ``2^-8`` of itself
(``--kv-cache-dtype bfloat16`` stores keys and values so)."""


def bf16_attention_bound(case: dict) -> np.ndarray:
    """``[T, H, 1]`` bound on how far exact attention over the bfloat16-rounded caches (``case``'s
    float32 caches, each value rounded to nearest: relative error ``<= U_BF16``) is from exact
    attention over the float32 caches.

    A rounded key moves each score ``s_j = scale q . k_j`` by at most ``Delta = U_BF16 scale
    max_j sum_d |q_d k_jd|``, so each softmax weight by a relative ``e^(2 Delta) - 1`` (numerator
    and normaliser each by ``e^Delta`` at most); the output, a convex combination of the value
    rows, then moves by ``(e^(2 Delta) - 1) max_j |v'_j|``, and the rounded values by ``U_BF16
    max_j |v_j|`` more (``v'_j`` the rounded rows, at most ``(1 + U_BF16) |v_j|``).
    """
    out = np.zeros(case["q"].shape[:2] + (1,))
    for t, h, n, qk, vmax in _query_rows(case):
        delta = U_BF16 * case["scale"] * qk
        out[t, h, 0] = math.expm1(2 * delta) * (1 + U_BF16) * vmax + U_BF16 * vmax
    return out


def kv_bf16_logit_atol(num_layers: int, logits: np.ndarray) -> float:
    """Bound on the logit difference between two forward passes that differ only in storing the
    keys and values in bfloat16 (``--kv-cache-dtype bfloat16``) instead of float32.

    The probabilistic model of ``forward_logit_atol`` with other roundings: per layer, each stored
    key and value is rounded once (relative ``U_BF16``), which perturbs the layer's attention
    output (a convex combination of the values, weighted through scores of order one) by about
    ``U_BF16`` relative for the values and as much again for the keys; independent across the
    ``L`` layers, the ``2 L`` perturbations add like a random walk, ``sqrt(2 L) U_BF16``, scaled
    by the largest logit's magnitude. The float32 roundings (``forward_logit_atol``: ``sqrt(L K)
    2^-24``, 1000x smaller at the default model) are inside it. Measured on the default model:
    0.04-0.19 of this bound on the golden prompts' first step."""
    return math.sqrt(2 * num_layers) * U_BF16 * float(np.abs(logits).max())
