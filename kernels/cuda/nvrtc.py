"""Compile CUDA C++ to PTX with NVRTC through ctypes: no GPU, driver or CuPy needed.

Used by the tests (every ``kernels/cuda/*.cu`` must compile for compute_80 and compute_90) and
handy to check a kernel edit on a machine without a GPU. The library comes from the pip package
``nvidia-cuda-nvrtc-cu12`` (or ``-cu13``), found through the ``nvidia`` namespace package, or from
``$FOLIO_NVRTC`` / the system loader path. API: NVIDIA NVRTC documentation (nvrtcCreateProgram,
nvrtcCompileProgram, nvrtcGetProgramLog, nvrtcGetPTX).
"""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib

_LIB = None


class NvrtcError(RuntimeError):
    """Compilation failed (the message holds NVRTC's log) or NVRTC is not available."""


def wheel_libraries(lib: str, subdirs: tuple[str, ...]) -> list[str]:
    """``lib.so*`` files in the pip ``nvidia-*`` wheels' folders (the ``nvidia`` namespace
    package), newest version first; ``[]`` when no such wheel is installed."""
    out = []
    try:
        import nvidia  # namespace package of the nvidia-* wheels
    except ImportError:
        return out
    for root in nvidia.__path__:
        for sub in subdirs:
            out += sorted(glob.glob(os.path.join(root, sub, f"{lib}.so*")), reverse=True)
    return out


def _candidates() -> list[str]:
    out = [os.environ["FOLIO_NVRTC"]] if os.environ.get("FOLIO_NVRTC") else []
    out += wheel_libraries("libnvrtc", ("cuda_nvrtc/lib", "cu13/lib", "cuda_nvrtc/lib64"))
    out += ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"]
    return [p for p in out if "builtins" not in p and ".alt." not in p]


def load_nvrtc() -> ctypes.CDLL:
    """The NVRTC shared library (cached).

    Raises:
        NvrtcError: none found.
    """
    global _LIB
    if _LIB is not None:
        return _LIB
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        _LIB = lib
        return lib
    raise NvrtcError("NVRTC not found (pip install nvidia-cuda-nvrtc-cu12): " + "; ".join(errors[-3:]))


def version() -> tuple[int, int]:
    lib = load_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_ptx(source: str, name: str = "kernel.cu", arch: str = "compute_80",
                options: tuple[str, ...] = ("-std=c++17",)) -> tuple[str, str]:
    """Compile ``source`` to PTX for virtual architecture ``arch``.

    Returns:
        ``(ptx, log)``; the log holds warnings, if any.
    Raises:
        NvrtcError: compilation failed (message = NVRTC's log) or NVRTC is missing.
    """
    lib = load_nvrtc()
    prog = ctypes.c_void_p()

    def check(rc, what):
        if rc != 0:
            raise NvrtcError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
          "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), *[o.encode() for o in options]]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise NvrtcError(f"{name} ({arch}): {lib.nvrtcGetErrorString(rc).decode()}\n{log}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx.value.decode(), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv=None) -> int:
    """``python -m folio.kernels.cuda.nvrtc [FILE.cu ...]``: compile (default: every kernel) for
    compute_80 and compute_90 and print a line per file."""
    import sys

    from .sources import KERNEL_FILES, kernel_source

    files = (argv if argv is not None else sys.argv[1:]) or list(KERNEL_FILES)
    rc = 0
    for f in files:
        src = kernel_source(pathlib.Path(f).resolve() if os.path.exists(f) else f)
        for arch in ("compute_80", "compute_90"):
            try:
                ptx, log = compile_ptx(src, pathlib.Path(f).name, arch)
                print(f"{f} {arch}: ok ({len(ptx)} bytes of PTX){' ' + log.strip() if log.strip() else ''}")
            except NvrtcError as e:
                print(f"{f} {arch}: FAILED\n{e}")
                rc = 1
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
