"""folio kernels: NumPy specs (reference.py), Numba CPU kernels (cpu.py), CUDA kernels (cuda/).

``get_kernels(device)`` returns the kernel table the forward pass is written against: an object
with ``xp`` (numpy or cupy) and the operations of ``reference.py`` plus ``linear``, ``embedding``,
``prepare_weight`` and ``kv_cache_dtype``. Only the table differs between CPU and GPU.
"""


import numpy as np


def to_numpy(a) -> np.ndarray:
    """A host NumPy array of ``a`` (copied from the device for a CuPy array, as is for NumPy)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def get_kernels(device: str):
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
