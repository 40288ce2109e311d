"""The CUDA kernel table on the CPU: kernels/cuda/*.cu under the SIMT emulator, NumPy for device
memory (kernels/cuda/device.py's HostDevice) and a NumPy GEMM in place of cuBLAS. Used by the tests and
by perf/gpu_check.sh's dry run (FOLIO_GPU_CHECK_DRY=1)."""

from __future__ import annotations

import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from folio.kernels.cuda import sources as cuda_sources
from folio.kernels.cuda import table as cuda_ops
from folio.kernels.cuda.table import CudaKernels, bf16_bits_to_float32
from folio.kernels.cuda.device import HostDevice

from .runner import SimtModule


_f32_weights: dict = {}  # id(weight) -> (weakref, float32 transpose); a forward reuses its weights


def _weight_f32(w):
    hit = _f32_weights.get(id(w))
    if hit is None or hit[0]() is not w:
        hit = _f32_weights[id(w)] = (weakref.ref(w), bf16_bits_to_float32(w).T)
        weakref.finalize(w, _f32_weights.pop, id(w), None)
    return hit[1]


def numpy_gemm(xb, w, out):
    """What cuBLAS gemmEx computes here: bf16 inputs (exact products), float32 accumulation (NumPy's
    BLAS; its summation order depends on the shape, as cuBLAS's does)."""
    np.matmul(bf16_bits_to_float32(xb), _weight_f32(w), out=out)


def simt_modules() -> dict:
    """kernel name -> SimtModule for every kernel file (g++ runs in parallel; cached on disk)."""
    with ThreadPoolExecutor(len(cuda_sources.KERNEL_FILES)) as pool:
        mods = list(pool.map(lambda f: SimtModule(cuda_sources.CUDA_DIR / f), cuda_sources.KERNEL_FILES))
    return {k: m for m in mods for k in m.kernels}


def simt_kernels(device=None, get_function=None, gemm=None) -> CudaKernels:
    """The CUDA kernel table over NumPy with every kernel run by the SIMT emulator (an H100/H200's
    227 KiB of opt-in shared memory per block). ``get_function`` / ``gemm`` wrap the defaults when
    given (``lambda name, default: ...``), e.g. to count launches."""
    names = simt_modules()

    def get(name):
        return names[name].get_function(name)

    if device is None:  # the size a profiling step sees ($FOLIO_SIMT_DEVICE_BYTES, default 1 GiB)
        device = HostDevice(total_bytes=int(os.environ.get("FOLIO_SIMT_DEVICE_BYTES", 1 << 30)))
    return CudaKernels(np, (lambda n: get_function(n, get)) if get_function else get,
                       gemm=gemm or numpy_gemm, smem_limit=227 * 1024, device=device,
                       kernel_names=cuda_sources.all_kernel_names())
