"""Every CuPy API folio calls, checked against the installed ``cupy`` package without a GPU.

The CUDA path (kernels/cuda/table.py, device.py, cublas.py; runtime/worker runs on them) has run on
the CPU only through the SIMT emulator and fakes, which accept whatever folio passes. This file
holds those calls against the real package (``cupy-cuda12x`` from the ``test`` extra; it imports
on a machine without a GPU or driver; the lent GPU's ``cupy-cuda13x`` has the same API), and the
fakes against CuPy's signatures, so a call CuPy would refuse fails here, not on the first GPU run.

What it checks:
  * ``RawKernel.__call__``: folio's launch path (``CudaKernels._launch`` -> ``HostDevice.launch``)
    driving a real ``cupy.RawKernel``: CuPy parses the arguments before it touches the device, so
    a 4th positional argument raises ``TypeError`` here, while the keyword call gets past the
    parsing and only then fails for want of a driver (``CUDARuntimeError``). The SIMT runner and the
    test fakes have exactly CuPy's documented signature (grid, block, args positional; the rest
    keyword-only), read from the docstring (Cython gives no ``inspect.signature`` for it).
  * Signatures, from ``inspect.signature`` where CuPy exposes one (``Stream``, ``Event``,
    ``RandomState``, ``MemoryHook``), else from the signature line Cython writes at the head of
    ``__doc__`` (``RawModule``, ``get_function``, ``Graph.launch``, ``ndarray.get`` / ``set``, the
    memory pool, ``alloc_pinned_memory``, ``cuda.runtime``): every keyword folio passes is a
    parameter, and the positional count fits.
  * Attributes: ``RawKernel.shared_size_bytes`` and the settable ``max_dynamic_shared_size_bytes``,
    ``Device.compute_capability`` / ``attributes``, ``Stream.ptr``, ``get_cublas_handle``.
  * Behaviour that needs no device: ``RawModule(code=, options=)`` constructs (it compiles lazily),
    ``CupyDevice.peak_tracker``'s memory hook installs and takes the keywords CuPy's pool passes.

What it cannot check (needs a GPU: perf/gpu_check.sh): the keywords ``RawKernel`` forwards to
``Function.__call__`` beyond the documented ``shared_mem`` (that method has neither a signature
nor a docstring), anything CuPy does only after creating a stream or allocating (capture modes,
the graph ``end_capture`` returns, pinned memory's buffer protocol, copy semantics), the values of
device attributes, and what cuBLAS does (called through ctypes, not CuPy: kernels/cuda/cublas.py;
the order of its handle calls is checked below with a recording library).
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

import cupy  # the test extra's cupy-cuda12x: a missing install is a failure, not a skip
from cupy.cuda import memory_hook
from cupy_backends.cuda.api.runtime import CUDARuntimeError

from folio.kernels.cuda.device import CupyDevice, HostDevice
from folio.kernels.cuda.table import CudaKernels

_DOC_SIG = re.compile(r"^\s*(?:[\w.]+\.)?(\w+)\((.*?)\)", re.S)


def doc_params(obj) -> list[tuple[str, str]]:
    """``[(name, kind)]`` from the signature line Cython puts first in ``__doc__``; kind is
    ``positional``, ``keyword`` (after ``*``), ``var_keyword``. ``self`` is dropped."""
    doc = obj.__doc__ or ""
    m = _DOC_SIG.match(doc)
    assert m, f"{obj!r}: no signature line in its docstring: {doc[:120]!r}"
    out, kind = [], "positional"
    for p in filter(None, (s.strip() for s in m.group(2).replace("\\*", "*").split(","))):
        if p == "*":
            kind = "keyword"
            continue
        if p.startswith("**"):
            out.append((p[2:], "var_keyword"))
            continue
        name = p.split("=")[0].strip().split()[-1]   # "size_t size" -> "size"
        if name != "self":
            out.append((name, kind))
    return out


def params(obj) -> list[tuple[str, str]]:
    """Parameters of ``obj`` (inspect.signature where CuPy exposes one, else its docstring)."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return doc_params(obj)
    kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
             inspect.Parameter.KEYWORD_ONLY: "keyword", inspect.Parameter.VAR_KEYWORD: "var_keyword",
             inspect.Parameter.VAR_POSITIONAL: "var_positional"}
    ps = [(n, kinds[p.kind]) for n, p in sig.parameters.items() if n != "self"]
    if ps == [("args", "var_positional"), ("kwargs", "var_keyword")]:  # a slot wrapper: says nothing
        return doc_params(obj)
    return ps


# (where folio calls it, the CuPy callable, positional arguments folio passes, keywords folio passes)
CALLS = [
    ("table.get_cuda_kernels", cupy.RawModule, 0, {"code", "options"}),
    ("table.get_cuda_kernels", cupy.RawModule.get_function, 1, set()),
    ("table.get_cuda_kernels", cupy.cuda.runtime.getDeviceCount, 0, set()),
    ("table.get_cuda_kernels", cupy.cuda.runtime.deviceSynchronize, 0, set()),
    ("table.random_weight", cupy.random.RandomState.standard_normal, 1, {"dtype"}),
    ("device.CupyDevice", cupy.cuda.Stream, 0, {"non_blocking"}),
    ("device.CupyDevice.capture", cupy.cuda.Stream.begin_capture, 0, set()),
    ("device.CupyDevice.capture", cupy.cuda.Stream.end_capture, 0, set()),
    ("device.CupyDevice.capture", cupy.cuda.graph.Graph.launch, 1, set()),
    ("device.CupyDevice.synchronize", cupy.cuda.Stream.synchronize, 0, set()),
    ("device.CupyDevice.pinned_empty", cupy.cuda.alloc_pinned_memory, 1, set()),
    ("device.CupyDevice.h2d", cupy.ndarray.set, 1, {"stream"}),
    ("device.CupyDevice.d2h", cupy.ndarray.get, 0, {"stream", "out", "blocking"}),
    ("device.CupyDevice.timer", cupy.cuda.Event, 0, set()),
    ("device.CupyDevice.timer", cupy.cuda.Event.record, 1, set()),
    ("device.CupyDevice.timer", cupy.cuda.get_elapsed_time, 2, set()),
    ("device.CupyDevice.memory", cupy.cuda.runtime.memGetInfo, 0, set()),
    ("device.CupyDevice.memory", cupy.cuda.MemoryPool.total_bytes, 0, set()),
    ("device.CupyDevice.peak_tracker", cupy.cuda.MemoryPool.used_bytes, 0, set()),
    ("model_runner.shutdown", cupy.cuda.MemoryPool.free_all_blocks, 0, set()),
    ("cublas.CublasGemm", cupy.cuda.get_current_stream, 0, set()),
    ("cublas.CublasGemm", cupy.cuda.device.get_cublas_handle, 0, set()),
]


@pytest.mark.parametrize("where, fn, npos, keywords", CALLS,
                         ids=[f"{c[0]}:{getattr(c[1], '__qualname__', c[1].__name__)}" for c in CALLS])
def test_every_cupy_call_fits_its_signature(where, fn, npos, keywords):
    ps = params(fn)
    names = {n for n, k in ps if k in ("positional", "keyword")}
    positional = [n for n, k in ps if k == "positional"]
    assert keywords <= names or any(k == "var_keyword" for _, k in ps), (where, ps, keywords - names)
    assert npos <= len(positional) or any(k == "var_positional" for _, k in ps), (where, ps, npos)
    for name in keywords:  # a keyword folio passes must not be taken positionally by what precedes it
        assert name not in positional[:npos], (where, name, positional)


def test_the_docstring_parser_reads_cythons_signature_lines():
    # (the checks above rest on it: a docstring signature parsed as CuPy wrote it)
    assert doc_params(cupy.ndarray.get) == [("stream", "positional"), ("order", "positional"),
                                             ("out", "positional"), ("blocking", "positional")]
    assert doc_params(cupy.cuda.alloc_pinned_memory) == [("size", "positional")]
    assert ("options", "keyword") in doc_params(cupy.RawModule)
    assert doc_params(cupy.cuda.runtime.memGetInfo) == []


# ---- kernel launches ---------------------------------------------------------------------------

def cupy_launch_signature():
    """CuPy's documented ``RawKernel.__call__``: the line after the Cython one in its docstring
    (``__call__(self, grid, block, args, \\*, shared_mem=0)``); the Cython line itself says
    ``(self, grid, block, args, **kwargs)``."""
    doc = cupy.RawKernel.__call__.__doc__
    lines = [ln for ln in doc.splitlines() if ln.strip().startswith("__call__(")]
    assert lines, doc[:300]
    declared = doc_params(cupy.RawKernel.__call__)
    assert declared[:3] == [("grid", "positional"), ("block", "positional"), ("args", "positional")], declared
    assert declared[3:] == [("kwargs", "var_keyword")], declared
    return doc_params(type("D", (), {"__doc__": lines[0]}))


def _fakes():
    from simt.runner import SimtKernel
    from support.fake_raw_kernel import FakeRawKernel

    return {"simt": SimtKernel.__call__, "support.fake_raw_kernel.FakeRawKernel": FakeRawKernel.__call__}


def test_kernel_fakes_have_cupys_launch_signature():
    documented = cupy_launch_signature()
    assert documented == [("grid", "positional"), ("block", "positional"), ("args", "positional"),
                          ("shared_mem", "keyword")], documented
    for name, fn in _fakes().items():
        ps = params(fn)
        assert ps[:3] == documented[:3], (name, ps)
        assert all(k == "keyword" for _, k in ps[3:]), (name, ps)   # everything else keyword-only
        assert ("shared_mem", "keyword") in ps, (name, ps)
        # RawKernel.__call__ passes enable_cooperative_groups to Function.__call__ itself: a caller
        # that gives it too gets "multiple values for keyword argument" on a GPU, so the fakes take
        # only what Function.__call__ leaves to the caller
        assert {p for p, _ in ps[3:]} <= {"shared_mem", "stream"}, (name, ps)


def _has_gpu() -> bool:
    """Whether the CUDA runtime sees a device (False without a driver: the CPU machines)."""
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except CUDARuntimeError:
        return False


class _NoCompileKernel(cupy.RawKernel):
    """A real RawKernel whose static shared size is given (reading CuPy's compiles, needs a GPU)."""

    shared_size_bytes = 0


@pytest.mark.parametrize("shared_mem", [0, 1024])
def test_folio_launches_pass_cupys_argument_parsing(shared_mem):
    # CudaKernels._launch -> HostDevice.launch -> a real cupy.RawKernel: CuPy checks the call's
    # shape (3 positional arguments, the rest keywords) before compiling or touching a device; a
    # call it accepts then asks the runtime for the current device (RawKernel._kernel), which on a
    # machine without a GPU or driver raises CUDARuntimeError from there, and on a GPU launches
    kern = _NoCompileKernel('extern "C" __global__ void k(float x) {}', "k")  # takes the float32 passed
    with pytest.raises(TypeError, match="3 positional arguments"):
        kern((1,), (32,), (np.float32(0),), shared_mem)   # the call folio made before issue 30
    kt = CudaKernels(np, lambda name: kern, gemm=None, device=HostDevice())
    if _has_gpu():
        kt._launch("k", (1,), (32,), (np.float32(0),), shared_mem=shared_mem)
        cupy.cuda.Device().synchronize()   # a launch error surfaces here
    else:
        with pytest.raises(CUDARuntimeError) as err:
            kt._launch("k", (1,), (32,), (np.float32(0),), shared_mem=shared_mem)
        # raised past the argument parsing, where RawKernel looks up its compiled function
        assert any(str(entry.path).endswith("raw.pyx") for entry in err.traceback), err.traceback
    # the graph recorder keeps the keyword too
    dev = HostDevice()
    calls = []
    with dev.capture() as g:
        dev.launch(lambda *a, **kw: calls.append((a, kw)), (1,), (32,), (), shared_mem=shared_mem)
    g.replay()
    assert calls == [(((1,), (32,), ()), {"shared_mem": shared_mem})]


def test_kernel_attributes_folio_uses():
    # CudaKernels._launch reads shared_size_bytes and raises max_dynamic_shared_size_bytes (opt-in)
    for attr in ("shared_size_bytes", "max_dynamic_shared_size_bytes"):
        assert inspect.isgetsetdescriptor(getattr(cupy.RawKernel, attr)), attr
    # get_function returns a RawKernel (so the attributes above are the ones folio reads)
    assert "RawKernel" in cupy.RawModule.get_function.__doc__
    m = cupy.RawModule(code='extern "C" __global__ void k() {}', options=("-std=c++17",))  # lazy: no GPU yet
    assert hasattr(m, "get_function")


def test_device_and_stream_attributes_folio_uses():
    for attr in ("compute_capability", "attributes", "synchronize"):
        assert hasattr(cupy.cuda.Device, attr), attr
    assert isinstance(cupy.cuda.Stream.null.ptr, int)  # cublas.py reads get_current_stream().ptr
    for attr in ("__enter__", "__exit__", "begin_capture", "end_capture", "synchronize"):
        assert hasattr(cupy.cuda.Stream, attr), attr
    assert "Graph" in cupy.cuda.Stream.end_capture.__doc__
    assert callable(cupy.get_default_memory_pool)
    assert isinstance(cupy.get_default_memory_pool(), cupy.cuda.MemoryPool)


def test_peak_tracker_hook_takes_the_keywords_cupys_pool_passes():
    # MemoryHook.malloc_postprocess(**kwargs): its docstring names the keywords the pool passes
    doc = cupy.cuda.memory_hook.MemoryHook.malloc_postprocess.__doc__
    passed = re.findall(r"^\s+(\w+)\s*\(\w+\):", doc, re.M)
    assert {"device_id", "size", "mem_size", "mem_ptr", "pmem_id"} <= set(passed), passed

    class Pool:
        def __init__(self):
            self.used = 100

        def used_bytes(self):
            return self.used

    dev = object.__new__(CupyDevice)   # no stream: CupyDevice() needs a GPU
    dev.cupy, dev._pool = cupy, Pool()
    with dev.peak_tracker() as peak:
        assert any(isinstance(h, memory_hook.MemoryHook) for h in memory_hook.get_memory_hooks().values())
        dev._pool.used = 300
        peak.malloc_postprocess(**{k: 1 for k in passed})
        dev._pool.used = 50
    assert peak.peak == 300


# ---- cuBLAS (ctypes, not CuPy): the order of the handle calls ------------------------------------

def test_cublas_workspace_is_set_again_after_every_set_stream():
    # cublasSetStream resets the handle's workspace to cuBLAS's default pool (cuBLAS docs), so
    # CublasGemm must call cublasSetWorkspace with its own buffer (from CuPy's pool) after each
    # cublasSetStream; else a GEMM captured into a CUDA graph would use memory cuBLAS allocates
    from types import SimpleNamespace

    from folio.kernels.cuda.cublas import WORKSPACE_BYTES, CublasGemm

    log = []

    class Fn:
        def __init__(self, name):
            self.name = name

        def __call__(self, *args):
            vals = [getattr(a, "value", a) for a in args[1:]]
            log.append((self.name, *vals))
            return 0

    class Lib:
        def __getattr__(self, name):
            fn = Fn(name.removesuffix("_v2"))
            setattr(self, name, fn)
            return fn

    ptrs = iter(range(0x1000, 0x100000, 0x1000))

    def buffer(*a, **kw):
        return SimpleNamespace(data=SimpleNamespace(ptr=next(ptrs)), shape=getattr(a[0], "shape", (a[0],)))

    current = [SimpleNamespace(ptr=7)]
    fake = SimpleNamespace(empty=buffer, asarray=buffer,
                           cuda=SimpleNamespace(get_current_stream=lambda: current[0]))
    g = CublasGemm(fake, lib=Lib())
    ws = g.workspace.data.ptr
    x = SimpleNamespace(shape=(3, 8), data=SimpleNamespace(ptr=1))
    w = SimpleNamespace(shape=(5, 8), data=SimpleNamespace(ptr=2))
    for stream in (7, 7, 9, 9, 7):
        current[0] = SimpleNamespace(ptr=stream)
        g(x, w, x)
    calls = [c[0] for c in log]
    assert calls[:3] == ["cublasCreate", "cublasSetWorkspace", "cublasSetPointerMode"], calls
    for i, name in enumerate(calls):
        if name == "cublasSetStream":
            assert log[i + 1] == ("cublasSetWorkspace", ws, WORKSPACE_BYTES), log[i:i + 2]
    assert [c[1] for c in log if c[0] == "cublasSetStream"] == [7, 9, 7]   # only when the stream changes
    assert calls.count("cublasGemmEx") == 5
