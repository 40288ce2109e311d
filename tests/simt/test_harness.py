"""The SIMT emulator runs CUDA warp/block semantics correctly and reports what would hang or be
undefined on a GPU (tests/simt/cases/harness_checks.cu)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from .runner import SimtError, SimtModule, require_compiler

CASES = pathlib.Path(__file__).resolve().parent / "cases" / "harness_checks.cu"


def gamma(k: int) -> float:
    """Higham's gamma_k for float32: the relative error bound of a k-operation sum."""
    return k * 2.0 ** -24 / (1 - k * 2.0 ** -24)


@pytest.fixture(scope="module")
def mod():
    require_compiler()
    return SimtModule(CASES)


def test_warp_shuffles_and_ballot(mod):
    rng = np.random.default_rng(0)
    n_blocks, nt = 2, 64
    x = rng.standard_normal(n_blocks * nt).astype(np.float32)
    out = np.zeros(4 * x.size, np.float32)
    ballots = np.zeros(x.size // 32, np.int32)
    mod.get_function("warp_ops")((n_blocks,), (nt,), (out, x, ballots))
    out = out.reshape(-1, 4)
    w = x.reshape(-1, 32)
    lane = np.arange(32)
    # a float32 sum of n terms in any order (here a shuffle tree) is within gamma_{n-1} sum |x| of the
    # exact sum, gamma_k = k u / (1 - k u), u = 2^-24 (Higham, "Accuracy and Stability of Numerical
    # Algorithms", 2nd ed., section 4.2); a relative tolerance on the sum has no such guarantee
    exact, mag = w.astype(np.float64).sum(1, keepdims=True), np.abs(w.astype(np.float64)).sum(1, keepdims=True)
    np.testing.assert_array_less(np.abs(out[:, 0].reshape(-1, 32) - exact), np.repeat(gamma(31) * mag, 32, 1))
    down = np.where(lane + 1 < 32, np.roll(w, -1, axis=1), w)  # lanes past the end keep their value
    np.testing.assert_array_equal(out[:, 1].reshape(-1, 32), down)
    np.testing.assert_array_equal(out[:, 2].reshape(-1, 32), np.repeat(w[:, 3:4], 32, 1))
    xor8 = (lane - lane % 8) + ((lane % 8) ^ 5)  # width 8: xor stays inside each 8-lane segment
    np.testing.assert_array_equal(out[:, 3].reshape(-1, 32), w[:, xor8])
    want_b = [(int(((row > 0) * (1 << lane)).sum()) + 2**31) % 2**32 - 2**31 for row in w]
    np.testing.assert_array_equal(ballots, want_b)


def test_block_reduction_and_dynamic_shared_memory(mod):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(3 * 96).astype(np.float32)
    out = np.zeros(3, np.float32)
    rev = np.zeros_like(x)
    mod.get_function("block_ops")((3,), (96,), (out, rev, x), shared_mem=96 * 4)
    x64 = x.reshape(3, 96).astype(np.float64)
    np.testing.assert_array_less(np.abs(out - x64.sum(1)), gamma(95) * np.abs(x64).sum(1))   # as above
    np.testing.assert_array_equal(rev.reshape(3, 96), x.reshape(3, 96)[:, ::-1])


def test_barrier_after_early_return_is_an_error_not_a_hang(mod):
    x = np.arange(64, dtype=np.float32)
    with pytest.raises(SimtError, match=r"exited while 50 threads wait at __syncthreads .*harness_checks.cu:\d+"):
        mod.get_function("early_return_before_barrier")((1,), (64,), (x, np.int32(50)))
    # all threads present: fine
    mod.get_function("early_return_before_barrier")((1,), (64,), (x, np.int32(64)))
    np.testing.assert_array_equal(x, np.roll(np.arange(64, dtype=np.float32), -1))


def test_divergent_barriers_are_reported(mod):
    with pytest.raises(SimtError, match="different __syncthreads"):
        mod.get_function("divergent_barriers")((1,), (32,), (np.zeros(32, np.float32),))


def test_deadlock_is_reported(mod):
    with pytest.raises(SimtError, match="deadlock"):
        mod.get_function("barrier_vs_shuffle")((1,), (32,), (np.zeros(32, np.float32),))


def test_argument_types_are_checked(mod):
    k = mod.get_function("typed_args")
    assert k.signature == ["ptr:f64", "i64", "ptr:u16"]
    d, h = np.zeros(1), np.array([7], np.uint16)
    k((1,), (32,), (d, np.int64(5), h))
    assert d[0] == 12.0
    with pytest.raises(TypeError, match="dtype float32 does not match parameter type f64"):
        k((1,), (32,), (np.zeros(1, np.float32), np.int64(5), h))
    with pytest.raises(TypeError, match="NumPy scalar"):
        k((1,), (32,), (d, 5, h))
    with pytest.raises(TypeError, match="scalar dtype int32 does not match parameter type i64"):
        k((1,), (32,), (d, np.int32(5), h))
    with pytest.raises(TypeError, match="C-contiguous"):
        k((1,), (32,), (np.zeros(4)[::2], np.int64(5), h))
    with pytest.raises(TypeError, match="takes 3 arguments"):
        k((1,), (32,), (d, np.int64(5)))


def test_bad_launch_configuration(mod):
    with pytest.raises(SimtError, match="1..1024"):
        mod.get_function("divergent_barriers")((1,), (2048,), (np.zeros(2048, np.float32),))
    with pytest.raises(SimtError, match="dynamic shared memory"):
        mod.get_function("block_ops")((1,), (32,), (np.zeros(1, np.float32), np.zeros(32, np.float32),
                                                    np.zeros(32, np.float32)), shared_mem=10**7)
