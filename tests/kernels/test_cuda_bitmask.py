"""The structured-outputs bitmask kernel (kernels/cuda/sampling.cu ``apply_token_bitmask_kernel``)
equals the NumPy spec (runtime/worker/sampler.py ``apply_token_bitmask``) bit for bit: it only
writes -inf or leaves a value, so no tolerance applies. Runs on the SIMT emulator without a GPU
(``FOLIO_TEST_CUDA=1``: the real kernel), as tests/kernels/test_cuda_kernels.py."""

from __future__ import annotations

import os

import numpy as np
import pytest

from folio.runtime.worker.sampler import apply_token_bitmask

ON_GPU = os.environ.get("FOLIO_TEST_CUDA", "") not in ("", "0")


@pytest.fixture(scope="module")
def kt():
    if ON_GPU:
        from folio.kernels.cuda.table import get_cuda_kernels
        return get_cuda_kernels()
    from simt.runner import require_compiler
    require_compiler()
    from simt.table import simt_kernels
    return simt_kernels()


@pytest.mark.parametrize("R, V, density", [(1, 31, 0.5), (3, 300, 0.5), (4, 1000, 0.02), (2, 513, 1.0)])
def test_bitmask_kernel_equals_the_spec(kt, R, V, density):
    rng = np.random.default_rng(V)
    logits = rng.standard_normal((R, V)).astype(np.float32)
    bits = rng.random((R, V)) < density
    W = (V + 31) // 32 + 1  # a wider mask than needed: the kernel reads only the words of V
    words = np.zeros((R, W), dtype=np.uint32)
    rows, cols = np.nonzero(bits)
    np.bitwise_or.at(words, (rows, cols // 32), (np.uint32(1) << (cols % 32).astype(np.uint32)))
    words = words.view(np.int32)
    expect = apply_token_bitmask(logits, words[:, :(V + 31) // 32])
    assert np.array_equal(expect, np.where(bits, logits, -np.inf))
    xp = kt.xp
    dev = xp.asarray(logits)
    kt.apply_token_bitmask(dev, xp.asarray(words))
    assert np.array_equal(kt.to_numpy(dev), expect)


def test_sampler_with_the_kernel_samples_what_it_samples_without(kt):
    # the sampler's whole pipeline on the NumPy table, mask applied by the kernel or by NumPy
    from folio import SamplingParams
    from folio.runtime.worker.sampler import SamplingState, sample
    if ON_GPU:
        pytest.skip("the emulated table's arrays are NumPy's; on a GPU test_device_step covers the device")
    rng = np.random.default_rng(1)
    R, V = 4, 200
    logits = rng.standard_normal((R, V)).astype(np.float32)
    words = rng.integers(-2**31, 2**31 - 1, (R, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    mk = lambda: [SamplingState(i, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i), [1], [], i, [0])  # noqa: E731
                  for i in range(R)]
    a = sample(logits, mk(), np, bitmask=words).token_ids
    b = sample(logits, mk(), np, bitmask=words, bitmask_kernel=kt.apply_token_bitmask).token_ids
    assert np.array_equal(a, b)
    bits = (words.view(np.uint32)[:, np.arange(V) // 32] >> (np.arange(V) % 32).astype(np.uint32)) & 1
    assert all(bits[r, t] for r, t in enumerate(a))  # every token is an allowed one
