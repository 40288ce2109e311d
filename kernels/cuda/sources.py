"""The CUDA sources: which ``*.cu`` files make up the kernels, each as one NVRTC translation unit.

Shared by the kernel table (``table.py``) and the compiler HTTP process (``nvrtc.py``).
"""

from __future__ import annotations

import pathlib
import re

CUDA_DIR = pathlib.Path(__file__).resolve().parent
KERNEL_FILES = ("layer.cu", "cache.cu", "attention.cu", "sampling.cu")


_INCLUDE_RE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)
KERNEL_NAME_RE = re.compile(r"__global__\s+void\s+(\w+)\s*\(")


def kernel_source(filename: str | pathlib.Path) -> str:
    """The source of ``kernels/cuda/<filename>`` (or of a path) with its local ``#include "..."``
    files inlined (once each), as one translation unit for NVRTC / ``cupy.RawModule``."""
    seen: set[str] = set()

    def expand(path: pathlib.Path) -> str:
        def sub(m):
            dep = (path.parent / m.group(1)).resolve()
            if not dep.exists():
                return m.group(0)
            if str(dep) in seen:
                return ""
            seen.add(str(dep))
            return expand(dep)

        return _INCLUDE_RE.sub(sub, path.read_text().replace("#pragma once", ""))

    path = pathlib.Path(filename)
    return expand(path if path.is_absolute() else CUDA_DIR / path)


def kernel_names(filename: str | pathlib.Path) -> list[str]:
    """The ``__global__`` entry points of one kernel file, in order."""
    path = pathlib.Path(filename)
    text = (path if path.is_absolute() else CUDA_DIR / path).read_text()
    return list(dict.fromkeys(KERNEL_NAME_RE.findall(text)))


def all_kernel_names() -> list[str]:
    """Every ``__global__`` entry point of ``KERNEL_FILES``, file by file."""
    return [k for f in KERNEL_FILES for k in kernel_names(f)]
