"""Compile CUDA C++ with NVRTC through ctypes: no GPU, driver or CuPy needed.

``compile_ptx`` makes PTX for a virtual architecture (``compute_80``); ``compile_cubin`` makes the
machine code (SASS) for a real one (``sm_90``), as CuPy does on a GPU, with ptxas's resource report
(``--ptxas-options=-v``: registers, spills, stack, static shared memory per kernel), which
``ptxas_resources`` parses. NVRTC runs ptxas itself (it links it in since CUDA 11.1), so no
``ptxas`` binary is needed.

Used by the tests (every ``kernels/cuda/*.cu`` must compile for compute_80 and compute_90, and the
static gates of tests/kernels/test_nvrtc.py: no spills, each hot kernel's occupancy) and handy to
check a kernel edit on a machine without a GPU. The library comes from the pip package
``nvidia-cuda-nvrtc-cu12`` (or ``-cu13``), found through the ``nvidia`` namespace package, or from
``$FOLIO_NVRTC`` / the system loader path. API: NVIDIA NVRTC documentation (nvrtcCreateProgram,
nvrtcCompileProgram, nvrtcGetProgramLog, nvrtcGetPTX, nvrtcGetCUBIN; "Supported Compile Options":
``--gpu-architecture=sm_XX`` makes a CUBIN, ``--ptxas-options``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import pathlib
import re

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
    ptx, log = _compile(source, name, arch, options, "PTX")
    return ptx.decode(), log


def compile_cubin(source: str, name: str = "kernel.cu", arch: str = "sm_90",
                  options: tuple[str, ...] = ("-std=c++17",)) -> tuple[bytes, str]:
    """Compile ``source`` to machine code for the real architecture ``arch`` (``sm_80``,
    ``sm_90``), with ptxas's verbose resource report in the log.

    Returns:
        ``(cubin, log)``: ``ptxas_resources(log)`` gives each kernel's registers and spills.
    Raises:
        NvrtcError: compilation failed or NVRTC is missing.
    """
    return _compile(source, name, arch, (*options, "--ptxas-options=-v"), "CUBIN")


_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PROPS_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers([^\n]*)")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def ptxas_resources(log: str) -> dict[str, dict]:
    """Per kernel of a ``compile_cubin`` log: ``{"arch", "registers", "spill_stores",
    "spill_loads", "stack", "smem"}`` (bytes; ``smem``: static shared memory).

    Raises:
        ValueError: an entry function whose report lacks its registers or spill line.
    """
    out = {}
    chunks = _ENTRY_RE.split(log)  # [before, name, arch, text, name, arch, text, ...]
    for name, arch, text in zip(chunks[1::3], chunks[2::3], chunks[3::3]):
        props, used = _PROPS_RE.search(text), _USED_RE.search(text)
        if not props or not used:
            raise ValueError(f"ptxas report of {name} has no resource lines:\n{text[:500]}")
        smem = _SMEM_RE.search(used.group(2))
        out[name] = {"arch": arch, "registers": int(used.group(1)), "spill_stores": int(props.group(2)),
                     "spill_loads": int(props.group(3)), "stack": int(props.group(1)),
                     "smem": int(smem.group(1)) if smem else 0}
    return out


def _compile(source: str, name: str, arch: str, options, what: str) -> tuple[bytes, str]:
    """NVRTC's output ``what`` (``"PTX"`` or ``"CUBIN"``) and the program log."""
    lib = load_nvrtc()
    prog = ctypes.c_void_p()

    def check(rc, call):
        if rc != 0:
            raise NvrtcError(f"{call}: {lib.nvrtcGetErrorString(rc).decode()}")

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
        getattr(lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size))
        data = ctypes.create_string_buffer(size.value)
        check(getattr(lib, f"nvrtcGet{what}")(prog, data), f"nvrtcGet{what}")
        return (data.value if what == "PTX" else data.raw), log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv=None) -> int:
    """``python -m folio.kernels.cuda.nvrtc [--resources] [FILE.cu ...]``: compile (default: every
    kernel) for compute_80 and compute_90 and print a line per file; with ``--resources``, compile
    for sm_80 and sm_90 and print each kernel's registers, spills and the blocks per SM its
    occupancy claim (kernels/cuda/occupancy.py) asks for and gets."""
    import sys

    from .occupancy import blocks_per_sm, occupancy_claims
    from .sources import KERNEL_FILES, kernel_source

    args = list(argv if argv is not None else sys.argv[1:])
    want_resources = "--resources" in args
    files = [a for a in args if a != "--resources"] or list(KERNEL_FILES)
    rc = 0
    for f in files:
        src = kernel_source(pathlib.Path(f).resolve() if os.path.exists(f) else f)
        if want_resources:
            claims = occupancy_claims(src)
            for arch in ("sm_80", "sm_90"):
                try:
                    _, log = compile_cubin(src, pathlib.Path(f).name, arch)
                except NvrtcError as e:
                    print(f"{f} {arch}: FAILED\n{e}")
                    rc = 1
                    continue
                for k, r in ptxas_resources(log).items():
                    line = (f"{arch} {k:40s} {r['registers']:4d} registers, spills {r['spill_stores']}/"
                            f"{r['spill_loads']} bytes, stack {r['stack']}, static smem {r['smem']}")
                    if k in claims:
                        blocks, threads, dyn = claims[k]
                        got = blocks_per_sm(arch, r["registers"], threads, r["smem"] + dyn)
                        line += f"; {got} blocks of {threads} per SM (claim >= {blocks})"
                    print(line)
            continue
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
