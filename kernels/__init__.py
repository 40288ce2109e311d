"""folio kernels: NumPy specs (reference.py), Numba CPU kernels (cpu/), CUDA kernels (cuda/).

``get_kernels(device)`` returns the kernel table the forward pass is written against, a
``table.KernelTable``: ``xp`` (numpy or cupy) and the operations of ``reference.py`` plus
``linear``, ``embedding``, ``prepare_weight`` and ``kv_cache_dtype``. Only the table differs
between CPU and GPU: the CPU's is also a ``table.CpuKernelTable``, the CUDA one a
``table.CudaKernelTable`` (the extras the GPU step calls, its device included); the model and the
runtime import neither ``cpu/`` nor ``cuda/`` (an import-linter contract in pyproject.toml).
"""

from __future__ import annotations

from .table import CompileJob, CpuKernelTable, CudaKernelTable, KernelDevice, KernelTable, to_numpy

__all__ = ["CompileJob", "CpuKernelTable", "CudaKernelTable", "KernelDevice", "KernelTable", "get_kernels", "to_numpy"]


def get_kernels(device: str) -> "KernelTable":
    """The kernel table for ``device`` (``"cpu"`` or ``"cuda"``).

    Raises:
        ValueError: unknown device.
        RuntimeError: ``"cuda"`` without a usable GPU / CuPy.
    """
    if device == "cpu":
        from .cpu.table import CPU_KERNELS

        return CPU_KERNELS
    if device == "cuda":
        from .cuda.table import get_cuda_kernels

        return get_cuda_kernels()
    raise ValueError(f"unknown device {device!r} (expected cpu or cuda)")
