"""bf16 matrix products through cuBLAS, called with ctypes on folio's own handle.

Why not CuPy's wrapper (``cupy_backends.cuda.libs.cublas``): every call there first binds the
handle to CuPy's current stream through its ``setStream``, which raises ``NotImplementedError``
while that stream is being captured into a CUDA graph ("calling cuBLAS API during stream capture
is currently unsupported"). cuBLAS itself supports capture (cuBLAS documentation, "CUDA Graphs
Support") when the handle has a user workspace (``cublasSetWorkspace``, so no allocation happens
inside the graph) and the scalars are device pointers. So folio creates its own handle in the
cuBLAS library CuPy already loaded, gives it a workspace and device-side alpha/beta, binds it to
the stream with ``cublasSetStream`` itself (only when the stream changes, each time followed by
``cublasSetWorkspace``, since cublasSetStream resets the workspace to cuBLAS's default pool), and
calls ``cublasGemmEx``. The same calls work in eager mode; this is the only GEMM path on a GPU.

Row-major ``out[T, N] = x[T, K] @ w[N, K]^T`` is the column-major ``out^T = op_T(w^T) x^T``:
``gemmEx(OP_T, OP_N, m=N, n=T, k=K, A=w (lda=K), B=x (ldb=K), C=out (ldc=N))``.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from .nvrtc import wheel_libraries

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_POINTER_MODE_DEVICE = 1
WORKSPACE_BYTES = 32 << 20  # cuBLAS's recommendation for Hopper


class CublasError(RuntimeError):
    """A cuBLAS call failed, or the library could not be found."""


def _loaded_cublas() -> list[str]:
    """Paths of libcublas already mapped into this process (CuPy loads it), then likely files."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                base = os.path.basename(path)
                if base.startswith("libcublas.so") and path not in found:
                    found.append(path)
    except OSError:
        pass
    found += [p for p in wheel_libraries("libcublas", ("cublas/lib", "cu13/lib", "cu12/lib")) if p not in found]
    return found + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]


class CublasGemm:
    """``gemm(x_bf16 [T, K] uint16, w_bf16 [N, K] uint16, out [T, N] float32)`` on the current
    CuPy stream; capturable into a CUDA graph.

    Args:
        cupy: the cupy module.
        lib: an already loaded ctypes library (tests), else libcublas is found as described above.
    Raises:
        CublasError: no usable libcublas, or handle setup failed.
    """

    def __init__(self, cupy, lib=None):
        self.cupy = cupy
        if lib is None:
            cupy.cuda.device.get_cublas_handle()  # makes CuPy load libcublas into the process
            errors = []
            for path in _loaded_cublas():
                try:
                    lib = ctypes.CDLL(path)
                    lib.cublasGemmEx  # noqa: B018 - the symbol must exist
                    break
                except (OSError, AttributeError) as e:
                    errors.append(f"{path}: {e}")
                    lib = None
            if lib is None:
                raise CublasError("libcublas not found: " + "; ".join(errors[-3:]))
        self.lib = lib
        vp, ci = ctypes.c_void_p, ctypes.c_int
        lib.cublasGemmEx.argtypes = [vp, ci, ci, ci, ci, ci, vp, vp, ci, ci, vp, ci, ci, vp, vp, ci, ci, ci, ci]
        lib.cublasGemmEx.restype = ci
        self.handle = vp()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        # the workspace comes from CuPy's pool (folio's memory): allocated when the kernel table is
        # built, before the KV sizing's profile, it is part of the pool's bytes in use that the
        # sizing subtracts (runtime/worker/model_runner.py, gpu_kv_budget)
        self.workspace = cupy.empty(WORKSPACE_BYTES, dtype=np.uint8)
        self._set_workspace()
        self._check(lib.cublasSetPointerMode_v2(self.handle, CUBLAS_POINTER_MODE_DEVICE), "cublasSetPointerMode")
        self.scalars = cupy.asarray(np.array([1.0, 0.0], dtype=np.float32))  # alpha, beta on the device
        self._alpha = self.scalars.data.ptr
        self._beta = self._alpha + 4
        self._stream = None

    @staticmethod
    def _check(status, what):
        if status != 0:
            raise CublasError(f"{what} failed with cuBLAS status {status}")

    def _set_workspace(self):
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   ctypes.c_size_t(WORKSPACE_BYTES)), "cublasSetWorkspace")

    def __call__(self, xb, w, out):
        stream = self.cupy.cuda.get_current_stream().ptr
        if stream != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")
            # cublasSetStream resets the workspace to cuBLAS's default pool (cuBLAS docs,
            # cublasSetStream): set folio's again, so no GEMM (captured or not) allocates its own
            self._set_workspace()
            self._stream = stream
        T, K = xb.shape
        N = w.shape[0]
        self._check(self.lib.cublasGemmEx(
            self.handle, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, self._alpha, w.data.ptr, CUDA_R_16BF, K,
            xb.data.ptr, CUDA_R_16BF, K, self._beta, out.data.ptr, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT), "cublasGemmEx")
