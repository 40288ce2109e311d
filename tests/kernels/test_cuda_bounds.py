"""The exact values tests/support/cuda_bounds.py checks the CUDA kernels against are the spec's
(kernels/reference.py), not a second implementation that could drift from it: every operation with
a bound, on the kernel test cases, without a GPU or the emulator.

The spec computes in float64 and returns float32, so it is the float64 value rounded once:
|spec - exact| <= u |exact| with u = 2^-24 (round to nearest, normal range). The bound module's
float64 evaluation follows the same formula; the two float64 evaluations differ by float64
rounding only (~1e-16 relative, allowed as 1e-12). The matrix product, which has no spec function
(the spec's products are NumPy's ``x @ w.T``), is checked against an exactly rounded sum
(``math.fsum``: the products of float32 values are exact in float64).
"""

import math

from support import cuda_bounds as B
import numpy as np
import pytest
from support.kernel_cases import cases_for

from folio.kernels import reference

RTOL = B.U + 1e-12   # the spec's one float32 rounding, plus float64 noise
TINY = 1e-40         # float32 subnormals: absolute


def _ids(cases):
    return [c[0] for c in cases]


def _same(spec, exact):
    np.testing.assert_allclose(spec, exact, rtol=RTOL, atol=TINY)


@pytest.mark.parametrize("case_id,build", cases_for("paged_attention"), ids=_ids(cases_for("paged_attention")))
def test_paged_attention_is_the_spec(case_id, build):
    c = build()
    args = (c["q"], c["key_cache"], c["value_cache"], c["block_tables"], c["seq_lens"], c["query_start_loc"],
            c["scale"])
    exact, _ = B.paged_attention(*args)
    _same(reference.paged_attention(*args), exact)


@pytest.mark.parametrize("case_id,build", cases_for("silu_and_mul"), ids=_ids(cases_for("silu_and_mul")))
def test_silu_and_mul_is_the_spec(case_id, build):
    x = build()["x"]
    exact, _ = B.silu_and_mul(x)
    _same(reference.silu_and_mul(x), exact)


@pytest.mark.parametrize("case_id,build", cases_for("rms_norm"), ids=_ids(cases_for("rms_norm")))
def test_rms_norm_is_the_spec(case_id, build):
    c = build()
    exact, _ = B.rms_norm(c["x"], c["weight"], c["eps"])
    _same(reference.rms_norm(c["x"], c["weight"], c["eps"]), exact)


@pytest.mark.parametrize("case_id,build", cases_for("rotary_embedding"), ids=_ids(cases_for("rotary_embedding")))
def test_rope_is_the_spec(case_id, build):
    c = build()
    q_rot, k_rot = reference.rotary_embedding(c["positions"], c["q"], c["k"], c["cos_sin_cache"])
    for got, x in ((q_rot, c["q"]), (k_rot, c["k"])):
        exact, _ = B.rope(c["positions"], x, c["cos_sin_cache"])
        _same(got, exact)


def test_linear_is_the_exact_product():
    rng = np.random.default_rng(3)
    x = B.bf16(rng.standard_normal((5, 70)).astype(np.float32))   # the kernels' bf16 inputs
    w = B.bf16(rng.standard_normal((9, 70)).astype(np.float32))
    exact, bound = B.linear(x, w)
    want = np.array([[math.fsum(float(a) * float(b) for a, b in zip(row, col)) for col in w] for row in x])
    # float64 sums of 70 exact products: within gamma_70 (float64) of sum |x w|
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    np.testing.assert_array_less(np.abs(exact - want), B.gamma64(70) * mag + TINY)
    np.testing.assert_allclose(bound, (2 * B.gamma(70) + 2 * B.gamma64(70)) * mag, rtol=1e-12)
