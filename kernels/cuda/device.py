"""The device services under the CUDA kernel table: launches, host <-> device copies, syncs, graphs.

``CudaKernels`` (kernels/cuda/table.py) and the model runner's device path touch the device only
through one of these objects, so the same code runs on a GPU (``CupyDevice``) and, in tests and in
``perf/gpu_check.sh``'s dry run, on the CPU (``HostDevice``: NumPy arrays, kernels run by the
SIMT emulator). Every launch, copy and synchronisation passes through a method here, which is also
where the tests count them per step.

Methods (both classes):
    activate(): context manager under which all of a step's work goes to the device's stream.
    launch(fn, *args, **kwargs): run ``fn(*args, **kwargs)`` on the device's stream (a kernel launch
        as ``kernel(grid, block, args, shared_mem=n)``, CuPy's ``RawKernel`` convention, or a cuBLAS
        call); while a graph is being captured it is recorded instead (CUDA stream capture).
    empty(shape, dtype): a device array; pinned_empty(nbytes): page-locked host bytes.
    h2d(dst, src) / d2h(dst, src): one asynchronous copy of a contiguous uint8 buffer.
    synchronize(): wait for the device's stream (the one host sync of a step).
    synchronize_device(): wait for all work on every stream of the device (cudaDeviceSynchronize):
        setup (weights, RoPE table, cuBLAS scalars, KV cache zeros) runs on the legacy default
        stream, which folio's non-blocking step stream does not wait for; called once at the end of
        the kernel table's build and of the model runner's setup (and before its profiling step).
    capture(): context manager capturing the launches of its body into a ``graph`` (its
        ``.replay()`` runs them again, same arguments: inputs must live in fixed buffers).
    timer(): a ``(mark, elapsed)`` pair: ``mark()`` records a point on the stream, and after the
        step's sync ``elapsed(a, b)`` gives the seconds between two marks (CUDA events on a GPU).
    memory(): ``(free_bytes, total_bytes, pool_held_bytes)``; peak_tracker(): context manager whose
        ``.peak`` is the most bytes the memory pool had in use inside it.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np


class _HostGraph:
    """The launches captured on a HostDevice; ``replay()`` runs them as one launch of the device
    (as cudaGraphLaunch is one launch)."""

    def __init__(self, device):
        self.device = device
        self.calls = []

    def _run(self):
        for fn, args, kwargs in self.calls:
            fn(*args, **kwargs)

    def replay(self):
        self.device.launch(self._run)


class HostDevice:
    """NumPy stands in for device memory; launches run at once (kernels under the SIMT emulator).

    Args:
        total_bytes: what ``memory()`` reports as the device's size (tests size a fake device).
    """

    name = "host"

    def __init__(self, total_bytes: int = 1 << 34):
        self.xp = np
        self._capturing: _HostGraph | None = None
        self.total_bytes = int(total_bytes)
        self._held = 0

    def activate(self):
        """Context manager making this device's stream current (nothing to do on the host)."""
        return contextlib.nullcontext()

    def launch(self, fn, *args, **kwargs):
        if self._capturing is not None:
            self._capturing.calls.append((fn, args, kwargs))
        else:
            fn(*args, **kwargs)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        return np.empty(int(nbytes), dtype=np.uint8)

    def h2d(self, dst, src):
        dst[: src.size] = src

    def d2h(self, dst, src):
        dst[: src.size] = src

    def synchronize(self):
        pass

    def synchronize_device(self):
        pass

    @contextlib.contextmanager
    def capture(self):
        graph = _HostGraph(self)
        self._capturing = graph
        try:
            yield graph
        finally:
            self._capturing = None

    def timer(self):
        def mark():
            return time.perf_counter()

        return mark, lambda a, b: b - a

    def memory(self):
        return self.total_bytes - self._held, self.total_bytes, 0

    @contextlib.contextmanager
    def peak_tracker(self):
        tracker = type("Peak", (), {"peak": 0})()
        yield tracker


class CupyDevice:
    """The GPU through CuPy: one non-blocking stream for all work (CUDA graphs cannot capture the
    legacy default stream), pinned host buffers, CUDA events for timings, CuPy's memory pool.

    Graph capture: ``cupy.cuda.Stream.begin_capture`` / ``end_capture`` (CuPy >= 10); the captured
    graph's ``launch(stream)`` replays it. Kernels launched inside ``with self.stream`` go to the
    capturing stream; cuBLAS calls go there through kernels/cuda/cublas.py, whose handle is bound to
    the stream with cublasSetStream directly (CuPy's own cuBLAS wrapper refuses during capture).
    """

    name = "cuda"

    def __init__(self, cupy):
        self.cupy = cupy
        self.xp = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._pool = cupy.get_default_memory_pool()

    def activate(self):
        """Context manager making folio's stream CuPy's current stream (kernel launches, cuBLAS
        calls and copies inside go to it)."""
        return self.stream

    def launch(self, fn, *args, **kwargs):
        fn(*args, **kwargs)

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype=dtype)

    def pinned_empty(self, nbytes: int) -> np.ndarray:
        mem = self.cupy.cuda.alloc_pinned_memory(int(nbytes))
        return np.frombuffer(mem, dtype=np.uint8, count=int(nbytes))

    def h2d(self, dst, src):
        dst[: src.size].set(src, stream=self.stream)

    def d2h(self, dst, src):
        src.get(stream=self.stream, out=dst[: src.size], blocking=False)

    def synchronize(self):
        self.stream.synchronize()

    def synchronize_device(self):
        self.cupy.cuda.runtime.deviceSynchronize()

    @contextlib.contextmanager
    def capture(self):
        holder = type("Graph", (), {})()
        self.stream.begin_capture()
        try:
            yield holder
        finally:
            graph = self.stream.end_capture()
            stream = self.stream
            holder.replay = lambda: graph.launch(stream)
            holder.graph = graph

    def timer(self):
        cupy = self.cupy

        def mark():
            ev = cupy.cuda.Event()
            ev.record(self.stream)
            return ev

        return mark, lambda a, b: cupy.cuda.get_elapsed_time(a, b) / 1e3

    def memory(self):
        free, total = self.cupy.cuda.runtime.memGetInfo()
        return int(free), int(total), int(self._pool.total_bytes())

    @contextlib.contextmanager
    def peak_tracker(self):
        """Peak bytes in use in CuPy's pool, from a memory hook (cupy.cuda.memory_hook)."""
        from cupy.cuda import memory_hook

        pool = self._pool

        class _Peak(memory_hook.MemoryHook):
            name = "FolioPeak"

            def __init__(self):
                self.peak = pool.used_bytes()

            def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
                self.peak = max(self.peak, pool.used_bytes())

        hook = _Peak()
        with hook:
            yield hook
