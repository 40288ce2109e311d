"""folio kernels: NumPy specs (reference.py), Numba CPU kernels (cpu.py), CUDA kernels (cuda/).

``get_kernels(device)`` returns the kernel table the forward pass is written against, a
``table.KernelTable``: ``xp`` (numpy or cupy) and the operations of ``reference.py`` plus
``linear``, ``embedding``, ``prepare_weight`` and ``kv_cache_dtype``. Only the table differs
between CPU and GPU.
"""

from __future__ import annotations


import numpy as np

from .table import KernelTable


def to_numpy(a) -> np.ndarray:
    """A host NumPy array of ``a`` (copied from the device for a CuPy array, as is for NumPy)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def get_kernels(device: str) -> "KernelTable":
    """The kernel table for ``device`` (``"cpu"`` or ``"cuda"``).

    Raises:
        ValueError: unknown device.
        RuntimeError: ``"cuda"`` without a usable GPU / CuPy.
    """
    if device == "cpu":
        from .cpu import CPU_KERNELS

        return CPU_KERNELS
    if device == "cuda":
        from .cuda_ops import get_cuda_kernels

        return get_cuda_kernels()
    raise ValueError(f"unknown device {device!r} (expected cpu or cuda)")
