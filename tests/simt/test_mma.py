"""mma.sync m16n8k16 (bf16 in, float32 accumulate) as kernels/cuda/common.cuh issues it, against
NumPy, with the fragment layouts of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating
point type") written out here independently of the emulator's C++.

On the SIMT emulator by default; with ``FOLIO_TEST_CUDA=1`` the same kernels run on the GPU
through CuPy, which checks the emulator's layout against the hardware's."""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from folio.kernels.cuda.table import bf16_bits_to_float32, float32_to_bf16_bits, kernel_source
from support.cuda_bounds import gamma, gamma64

from .runner import SimtModule, require_compiler

CASES = pathlib.Path(__file__).resolve().parent / "cases" / "mma_checks.cu"
ON_GPU = os.environ.get("FOLIO_TEST_CUDA", "") not in ("", "0")


class _Gpu:
    """The same kernels through cupy.RawModule, NumPy in and out."""

    def __init__(self):
        import cupy

        self.cupy = cupy
        self.mod = cupy.RawModule(code=kernel_source(CASES), options=("-std=c++17",))

    def get_function(self, name):
        cupy, f = self.cupy, self.mod.get_function(name)

        def call(grid, block, args, *, shared_mem=0, stream=None):
            # RawKernel.__call__ sets enable_cooperative_groups itself (from the kernel's
            # attribute): passing it again is a TypeError on a real GPU
            dev = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
            f(grid, block, dev, shared_mem=shared_mem, stream=stream)
            for a, d in zip(args, dev):
                if isinstance(a, np.ndarray):
                    a[...] = d.get()

        return call


@pytest.fixture(scope="module")
def mod():
    if ON_GPU:
        return _Gpu()
    require_compiler()
    return SimtModule(CASES)


def a_position(lane, i):
    """Row and column of A element a_i (i = 0..7) held by ``lane``."""
    g, t = lane >> 2, lane % 4
    row = g if (i < 2 or 4 <= i < 6) else g + 8
    col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def b_position(lane, i):
    """Row (k) and column (n) of B element b_i (i = 0..3)."""
    g, t = lane >> 2, lane % 4
    return 2 * t + (i & 1) + (8 if i >= 2 else 0), g


def c_position(lane, i):
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), 2 * t + (i & 1)


def _pack(lo, hi):
    return np.uint32(lo) | (np.uint32(hi) << np.uint32(16))


def test_layouts_cover_each_matrix_once():
    for pos, n, shape in ((a_position, 8, (16, 16)), (b_position, 4, (16, 8)), (c_position, 4, (16, 8))):
        seen = np.zeros(shape, int)
        for lane in range(32):
            for i in range(n):
                seen[pos(lane, i)] += 1
        assert (seen == 1).all()


def test_mma_fragments_match_numpy(mod):
    rng = np.random.default_rng(0)
    A = float32_to_bf16_bits(rng.standard_normal((16, 16)).astype(np.float32))
    Bm = float32_to_bf16_bits(rng.standard_normal((16, 8)).astype(np.float32))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    a_in = np.zeros((32, 4), np.uint32)
    b_in = np.zeros((32, 2), np.uint32)
    c_in = np.zeros((32, 4), np.float32)
    for lane in range(32):
        a = [A[a_position(lane, i)] for i in range(8)]
        b = [Bm[b_position(lane, i)] for i in range(4)]
        a_in[lane] = [_pack(a[2 * r], a[2 * r + 1]) for r in range(4)]  # low half first
        b_in[lane] = [_pack(b[2 * r], b[2 * r + 1]) for r in range(2)]
        c_in[lane] = [C[c_position(lane, i)] for i in range(4)]
    d_out = np.zeros((32, 4), np.float32)
    mod.get_function("mma_fragments")((1,), (32,), (d_out, a_in, b_in, c_in))
    D = np.zeros((16, 8), np.float32)
    for lane in range(32):
        for i in range(4):
            D[c_position(lane, i)] = d_out[lane, i]
    want = bf16_bits_to_float32(A).astype(np.float64) @ bf16_bits_to_float32(Bm) + C
    # exact products; 16 float32 additions (tensor cores may truncate): 2 gamma_17 of sum |terms|,
    # plus the float64 evaluation of want and mag here (17 terms each; bf16 products are exact)
    mag = np.abs(bf16_bits_to_float32(A)).astype(np.float64) @ np.abs(bf16_bits_to_float32(Bm)) + np.abs(C)
    assert (np.abs(D - want) <= (2 * gamma(17) + 2 * gamma64(17)) * mag).all()


def test_tiled_matmul_reads_fragments_from_memory(mod):
    # the attention kernel's way of reading fragments (32-bit pairs from row-major tiles),
    # accumulating over three k-steps and several output tiles
    rng = np.random.default_rng(1)
    M, N, K = 32, 16, 48
    a = float32_to_bf16_bits(rng.standard_normal((M, K)).astype(np.float32))
    b = float32_to_bf16_bits(rng.standard_normal((N, K)).astype(np.float32))
    out = np.zeros((M, N), np.float32)
    mod.get_function("mma_matmul")((M // 16, N // 8), (32,), (out, a, b, np.int32(K), np.int32(N)))
    af, bf = bf16_bits_to_float32(a).astype(np.float64), bf16_bits_to_float32(b).astype(np.float64)
    # 2 gamma_K of sum |a b| (tensor-core accumulation), plus the float64 evaluation here
    bound = (2 * gamma(K) + 2 * gamma64(K)) * (np.abs(af) @ np.abs(bf).T)
    assert (np.abs(out - af @ bf.T) <= bound).all()


@pytest.mark.skipif(ON_GPU, reason="emulator behaviour")
def test_mma_needs_the_whole_warp(mod):
    from .runner import SimtError

    with pytest.raises(SimtError, match="mma.sync needs a full warp"):
        mod.get_function("mma_fragments")((1,), (16,), (np.zeros((32, 4), np.float32), np.zeros((32, 4), np.uint32),
                                                         np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)))
