"""Run CUDA kernel sources on the CPU: build them with g++ behind ``simt.h`` and launch via ctypes.

``SimtModule(path)`` compiles one ``.cu`` file (its ``#include "..."`` files resolved next to it)
into a shared library in a cache folder outside the repository (``$FOLIO_SIMT_CACHE``, default
``~/.cache/folio/simt``), keyed by a hash of every input, and exposes its ``extern "C"
__global__`` kernels with CuPy's calling convention: ``module.get_function(name)(grid, block,
args, *, shared_mem=0)`` (shared_mem keyword-only, as in CuPy). So the code that launches CuPy RawKernels on a GPU can run unchanged on
NumPy arrays. Every argument is checked against the kernel's parameter types (taken from the
compiled function's C++ type): an array's dtype must match the pointee type and the array must be
C-contiguous; a scalar must be a NumPy scalar of exactly the parameter's type (as CuPy requires
for correct widths).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import functools
import threading

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
CXXFLAGS = ["-std=c++20", "-O2", "-fPIC", "-shared", "-fno-strict-aliasing", "-w", "-fvisibility=hidden"]


def find_cxx() -> str | None:
    """The C++20 compiler to use: ``$CXX``, else g++, c++ or clang++ on PATH; None if none."""
    for c in filter(None, [os.environ.get("CXX"), "g++", "c++", "clang++"]):
        if shutil.which(c):
            return c
    return None


@functools.lru_cache(maxsize=None)
def _flags(cxx: str) -> list[str]:
    # GCC: keep inline statics out of the process-wide unique-symbol table, so each library has
    # its own kernel registry and scheduler state
    gcc = "clang" not in os.path.basename(cxx) and "clang" not in subprocess.run(
        [cxx, "--version"], capture_output=True, text=True).stdout
    return tuple(CXXFLAGS + (["-fno-gnu-unique"] if gcc else []))

_DTYPE_CODE = {
    np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.float16): "f16",
    np.dtype(np.int8): "i8", np.dtype(np.uint8): "u8", np.dtype(np.int16): "i16",
    np.dtype(np.uint16): "u16", np.dtype(np.int32): "i32", np.dtype(np.uint32): "u32",
    np.dtype(np.int64): "i64", np.dtype(np.uint64): "u64", np.dtype(np.bool_): "bool",
}
_CTYPE = {
    "f32": ctypes.c_float, "f64": ctypes.c_double, "i8": ctypes.c_int8, "u8": ctypes.c_uint8,
    "i16": ctypes.c_int16, "u16": ctypes.c_uint16, "i32": ctypes.c_int32, "u32": ctypes.c_uint32,
    "i64": ctypes.c_int64, "u64": ctypes.c_uint64, "bool": ctypes.c_bool,
}
_GLOBAL_RE = re.compile(r"__global__\s+void\s+(\w+)\s*\(")
_DYN_SMEM_RE = re.compile(r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w\s]*?)\s+(\w+)\s*\[\s*\]")
_INCLUDE_RE = re.compile(r'#include\s+"([^"]+)"')
_locks: dict = {}
_locks_guard = threading.Lock()


class SimtError(RuntimeError):
    """A kernel failed under the emulator (barrier divergence, deadlock, bad launch, bad argument)."""


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FOLIO_SIMT_CACHE", pathlib.Path.home() / ".cache" / "folio" / "simt"))


def _sources(path: pathlib.Path, seen=None) -> list[pathlib.Path]:
    seen = seen if seen is not None else []
    if path in seen:
        return seen
    seen.append(path)
    for inc in _INCLUDE_RE.findall(path.read_text()):
        dep = path.parent / inc
        if dep.exists():
            _sources(dep, seen)
    return seen


def _generated_tu(cu: pathlib.Path) -> str:
    text = cu.read_text()
    kernels = list(dict.fromkeys(_GLOBAL_RE.findall(text)))
    smem = dict((name, typ) for typ, name in _DYN_SMEM_RE.findall(text))
    # the dynamic shared arrays are defined before the kernels declare them (a block-scope
    # `extern thread_local` seen before its definition would go through a TLS init wrapper)
    lines = ['#include "simt.h"']
    for name, typ in smem.items():
        lines.append(f"alignas(16) thread_local {typ} {name}[SIMT_DYN_SMEM_BYTES / sizeof({typ})];")
    lines += [f'#include "{cu}"', f'#include "{HERE / "launcher.cpp"}"']
    for name in smem:
        lines.append(f"static simt::Registrar simt_smem_{name}([]() -> void* {{ return (void*){name}; }}, sizeof({name}));")
    for k in kernels:
        lines.append(f'static simt::Registrar simt_reg_{k}("{k}", &{k});')
    return "\n".join(lines) + "\n"


def build(cu: str | os.PathLike) -> pathlib.Path:
    """Compile ``cu`` for the emulator (cached); returns the shared library's path.

    Raises:
        SimtError: the compiler failed (its output is in the message).
    """
    cu = pathlib.Path(cu).resolve()
    cxx = find_cxx()
    if cxx is None:
        raise SimtError("no C++20 compiler found (set $CXX or install g++ / clang++)")
    flags = _flags(cxx)
    tu = _generated_tu(cu)
    h = hashlib.sha256()
    for p in _sources(cu) + [HERE / "simt.h", HERE / "launcher.cpp", pathlib.Path(__file__).resolve()]:
        h.update(p.read_bytes())
    h.update(tu.encode())
    h.update(" ".join([cxx, *flags]).encode())
    out = cache_dir() / f"{cu.stem}-{h.hexdigest()[:16]}.so"
    with _locks_guard:
        lock = _locks.setdefault(out, threading.Lock())
    with lock:
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.cpp")
        src.write_text(tu)
        tmp = out.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        cmd = [cxx, *flags, f"-I{HERE}", f"-I{HERE / 'include'}", f"-I{cu.parent}", str(src), "-o", str(tmp)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        src.unlink(missing_ok=True)
        if r.returncode != 0:
            raise SimtError(f"g++ failed on {cu.name}:\n{r.stderr[-4000:]}")
        os.replace(tmp, out)
    return out


def require_compiler() -> None:
    """pytest helper: skip when no C++ compiler is installed, unless ``FOLIO_REQUIRE_SIMT=1`` (CI)
    makes that a failure."""
    import pytest

    if find_cxx() is None:
        msg = "SIMT emulator tests need a C++20 compiler (g++ or clang++; or set $CXX)"
        if os.environ.get("FOLIO_REQUIRE_SIMT", "") not in ("", "0"):
            pytest.fail(msg)
        pytest.skip(msg)


class SimtKernel:
    """One kernel, called like a CuPy RawKernel: ``kernel(grid, block, args, *, shared_mem=0)``."""

    def __init__(self, module: "SimtModule", index: int, name: str, signature: list[str]):
        self._module, self._index, self.name, self.signature = module, index, name, signature

    def _convert(self, j: int, code: str, a):
        where = f"{self.name} argument {j}"
        if code.startswith("ptr:"):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{where}: expected an array for {code}, got {type(a).__name__}")
            want = code[4:]
            if want not in ("void", "?") and _DTYPE_CODE.get(a.dtype) != want:
                raise TypeError(f"{where}: array dtype {a.dtype} does not match parameter type {want}*")
            if not a.flags.c_contiguous:
                raise TypeError(f"{where}: array must be C-contiguous")
            return ctypes.c_void_p(a.ctypes.data)
        if isinstance(a, np.ndarray) or not isinstance(a, np.generic):
            raise TypeError(f"{where}: expected a NumPy scalar of type {code}, got {type(a).__name__} "
                            "(CuPy would guess its width)")
        if _DTYPE_CODE.get(a.dtype) != code:
            raise TypeError(f"{where}: scalar dtype {a.dtype} does not match parameter type {code}")
        return _CTYPE[code](a.item())

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None):
        """CuPy's signature exactly: ``RawKernel.__call__(grid, block, args, **kwargs)`` forwards to
        ``Function.__call__(tuple grid, tuple block, args, size_t shared_mem=0, stream=None,
        enable_cooperative_groups=False)`` and passes ``enable_cooperative_groups`` itself (from the
        kernel's attribute), so a caller may give only ``shared_mem`` and ``stream``: giving
        ``enable_cooperative_groups`` too is a TypeError on a real GPU (the first H200 run found a
        test wrapper doing so), as is a 4th positional argument. grid / block must be tuples, as
        CuPy's typed parameters require (tests/kernels/test_cupy_conformance.py checks this signature
        against the installed CuPy). ``stream`` is accepted and ignored (one host "stream")."""
        if not isinstance(grid, tuple) or not isinstance(block, tuple):
            raise TypeError(f"{self.name}: grid and block must be tuples (CuPy declares them `tuple`), got "
                            f"{type(grid).__name__} / {type(block).__name__}")
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"{self.name}: args must be a tuple or list, got {type(args).__name__}")
        grid = grid + (1,) * (3 - len(grid))
        block = block + (1,) * (3 - len(block))
        if len(args) != len(self.signature):
            raise TypeError(f"{self.name} takes {len(self.signature)} arguments, got {len(args)}")
        vals = [self._convert(j, code, a) for j, (code, a) in enumerate(zip(self.signature, args))]
        argv = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        lib = self._module.lib
        rc = lib.simt_launch(self._index, *[int(x) for x in grid], *[int(x) for x in block],
                             int(shared_mem), argv)
        if rc != 0:
            raise SimtError(f"{self.name}: {lib.simt_last_error().decode()}")


class SimtModule:
    """The kernels of one ``.cu`` file, compiled for the emulator (cf. ``cupy.RawModule``)."""

    def __init__(self, cu: str | os.PathLike):
        self.path = build(cu)
        lib = ctypes.CDLL(str(self.path))
        lib.simt_kernel_name.restype = ctypes.c_char_p
        lib.simt_kernel_signature.restype = ctypes.c_char_p
        lib.simt_last_error.restype = ctypes.c_char_p
        lib.simt_switch_count.restype = ctypes.c_longlong
        lib.simt_launch.argtypes = [ctypes.c_int] + [ctypes.c_uint] * 6 + [ctypes.c_ulonglong, ctypes.c_void_p]
        self.lib = lib
        self.kernels = {}
        for i in range(lib.simt_num_kernels()):
            name = lib.simt_kernel_name(i).decode()
            sig = lib.simt_kernel_signature(i).decode()
            self.kernels[name] = SimtKernel(self, i, name, sig.split(",") if sig else [])

    def get_function(self, name: str) -> SimtKernel:
        try:
            return self.kernels[name]
        except KeyError:
            raise KeyError(f"no kernel {name!r} in {self.path.name}; have {sorted(self.kernels)}") from None

    def switch_count(self) -> int:
        return self.lib.simt_switch_count()
