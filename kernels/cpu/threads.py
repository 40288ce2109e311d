"""The CPU engine's threading policy: one thread pool, Numba's, for the whole forward pass.

Every parallel kernel of ``kernels/cpu*.py`` runs in a Numba ``prange`` region with one task per
thread of Numba's pool; matrix products are split into tiles that those same threads compute
with *single-threaded* BLAS ``sgemm`` calls. So there is exactly one set of worker threads:

* **Numba threads**: ``NUMBA_NUM_THREADS``, whose default (Numba's own) is the number of cores
  this process may run on (``os.sched_getaffinity``). ``folio bench --threads N`` and the
  ``NUMBA_NUM_THREADS`` environment variable choose another count.
* **BLAS threads**: held at one with ``threadpoolctl`` when the CPU kernel table is first used
  (``apply_thread_policy``). A multi-threaded OpenBLAS next to a Numba pool means two sets of
  threads on the same cores; OpenBLAS's idle workers keep spinning after each call, so the
  Numba region that follows would run with a core missing.
* **Dynamic work distribution**: a region's tasks take work items (tiles, KV-head groups, weight
  row blocks) from one shared atomic counter (``fetch_add``), largest items first where sizes
  differ. A thread that the OS delays (a busy machine) holds back only the item it is on, not a
  fixed share of the region.
* **No allocation inside regions**: per-thread scratch buffers are allocated by the caller and
  indexed by task number.

``sgemm`` is BLAS's ``cblas_sgemm`` (row-major, 64-bit integers) called from compiled code
without the GIL. It is the one that NumPy itself loaded (found with ``threadpoolctl``: NumPy's
PyPI wheels carry an ILP64 OpenBLAS whose symbols are ``scipy_cblas_sgemm64_`` (NumPy 2) or
``cblas_sgemm64_`` (NumPy 1.2x)); when none is found (or ``FOLIO_CPU_SGEMM=fallback``), a
Numba loop with the same signature takes its place (correct, several times slower), and
``blas_name()`` says which one runs.

Sources: Numba's threading layers and ``numba.set_num_threads`` (numba.readthedocs.io, "The
Threading Layers", "Setting the Number of Threads"); threadpoolctl (github.com/joblib/
threadpoolctl); the CBLAS interface (netlib BLAS, "C interface to the Legacy BLAS").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

# Before Numba starts its OpenMP pool (at the first parallel call): threads that finish a region
# sleep at once instead of spinning (GNU OpenMP spins up to GOMP_SPINCOUNT = 300000 pauses by
# default): on a busy machine a spinning thread holds the core its partner needs. The user's own
# OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. OMP_WAIT_POLICY_SET_BY_FOLIO tells child processes
# (benchmark peers) to drop it again.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "passive"
    os.environ["OMP_WAIT_POLICY_SET_BY_FOLIO"] = "1"

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import jit_cache  # noqa: F401  (before any kernel is defined: one cache stamp for all of them)

__all__ = ["apply_thread_policy", "default_num_threads", "num_threads", "numba_threads", "region_guard", "blas_name",
           "sgemm", "ptr", "prefetch", "fetch_add", "atomic_add", "atomic_load", "sched_yield", "ROW_MAJOR", "NO_TRANS",
           "TRANS"]

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS enum values

_SGEMM_SYMBOL = "folio_cblas_sgemm"
# void cblas_sgemm(order, transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc), 64-bit ints
_i32, _i64, _f32 = types.int32, types.int64, types.float32
_SGEMM_SIG = types.void(_i32, _i32, _i32, _i64, _i64, _i64, _f32, types.voidptr, _i64, types.voidptr, _i64,
                        _f32, types.voidptr, _i64)
_BLAS_CANDIDATES = ("scipy_cblas_sgemm64_", "cblas_sgemm64_")

sgemm = types.ExternalFunction(_SGEMM_SYMBOL, _SGEMM_SIG)
"""``cblas_sgemm`` callable from ``@njit`` code: ``sgemm(ROW_MAJOR, ta, tb, M, N, K, alpha, ptr(A, i),
lda, ptr(B, j), ldb, beta, ptr(C, k), ldc)``; computes ``C = alpha op(A) op(B) + beta C`` in float32."""


@intrinsic
def ptr(typingctx, arr, offset):
    """``void*`` address of element ``offset`` (counted in elements, row-major) of array ``arr``."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.bitcast(builder.gep(a.data, [args[1]]), cgutils.voidptr_t)
    return types.voidptr(arr, types.int64), codegen


@intrinsic
def prefetch(typingctx, arr, offset):
    """Hint the CPU to load the cache line of element ``offset`` (flat, in elements) of ``arr``
    into L2 (LLVM ``llvm.prefetch``: read, locality 2, ``prefetcht1`` on x86); no effect on
    results. Into L2, not L1 (locality 3): decode attention requests a KV block's lines in bursts
    of dozens, more than the L1's miss buffers hold."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.bitcast(builder.gep(a.data, [args[1]]), cgutils.voidptr_t)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32,
                                                                                               i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.none(arr, types.int64), codegen


@intrinsic
def fetch_add(typingctx, counter, value):
    """Atomically add ``value`` to ``counter[0]`` (int64 array) and return the old value."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", a.data, args[1], "monotonic")
    return types.int64(counter, types.int64), codegen


@intrinsic
def atomic_add(typingctx, arr, index, value):
    """Atomically add ``value`` to ``arr[index]`` (flat, int64) and return the old value, with
    acquire-release ordering: what this thread wrote before is visible to a thread that reads
    the new value with ``atomic_load`` (a phase's claim and "items done" counts in ``forward.py``)."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", builder.gep(a.data, [args[1]]), args[2], "acq_rel")
    return types.int64(arr, types.int64, types.int64), codegen


@intrinsic
def atomic_load(typingctx, arr, index):
    """``arr[index]`` (flat, int64) read atomically with acquire ordering (see ``atomic_add``)."""
    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.load_atomic(builder.gep(a.data, [args[1]]), "acquire", 8)
    return types.int64(arr, types.int64), codegen


@cfunc(types.int32(), nopython=True, cache=True)
def _no_yield():
    return 0


def _sched_yield_address() -> int:
    try:
        return ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value
    except (OSError, AttributeError):  # pragma: no cover - not POSIX: spin without yielding
        return _no_yield.address


_YIELD_SYMBOL = "folio_sched_yield"
llvm_binding.add_symbol(_YIELD_SYMBOL, _sched_yield_address())
sched_yield = types.ExternalFunction(_YIELD_SYMBOL, types.int32())
"""POSIX ``sched_yield()`` callable from ``@njit`` code: give the core to another runnable thread."""


@cfunc(_SGEMM_SIG, nopython=True, fastmath=True, cache=True)
def _sgemm_fallback(order, transa, transb, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc):
    # Row-major only (the kernels never ask for another order). Loop orders that LLVM
    # vectorises: dot products along k when B is transposed (QK^T, x W^T), rows of B scaled
    # into rows of C otherwise (PV); the transposition tests are loop-invariant (unswitched).
    A = numba.carray(a, (M * lda if transa == NO_TRANS else K * lda,), np.float32)
    B = numba.carray(b, (K * ldb if transb == NO_TRANS else N * ldb,), np.float32)
    C = numba.carray(c, (M * ldc,), np.float32)
    for i in range(M):
        for j in range(N):
            C[i * ldc + j] = C[i * ldc + j] * beta if beta != 0 else np.float32(0.0)
        if transb == TRANS:
            for j in range(N):
                acc = np.float32(0.0)
                if transa == NO_TRANS:
                    for k in range(K):
                        acc += A[i * lda + k] * B[j * ldb + k]
                else:
                    for k in range(K):
                        acc += A[k * lda + i] * B[j * ldb + k]
                C[i * ldc + j] += alpha * acc
        else:
            for k in range(K):
                av = alpha * (A[i * lda + k] if transa == NO_TRANS else A[k * lda + i])
                for j in range(N):
                    C[i * ldc + j] += av * B[k * ldb + j]


def _find_blas_sgemm():
    """(address, description) of the cblas_sgemm NumPy loaded, or (None, reason)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # pragma: no cover - a dependency
        return None, "threadpoolctl missing"
    for info in threadpool_info():
        if info.get("user_api") != "blas":
            continue
        try:
            lib = ctypes.CDLL(info["filepath"])
        except OSError:
            continue
        for name in _BLAS_CANDIDATES:
            fn = getattr(lib, name, None)
            if fn is not None:
                return ctypes.cast(fn, ctypes.c_void_p).value, f"{info.get('internal_api')} {info.get('version')} " \
                    f"({os.path.basename(info['filepath'])}:{name})"
    return None, "no ILP64 cblas_sgemm in the BLAS NumPy loaded"


_addr, _blas_desc = (None, "FOLIO_CPU_SGEMM=fallback") if os.environ.get("FOLIO_CPU_SGEMM") == "fallback" \
    else _find_blas_sgemm()
if _addr is None:
    _blas_desc = f"Numba loop fallback ({_blas_desc})"
    _addr = _sgemm_fallback.address
llvm_binding.add_symbol(_SGEMM_SYMBOL, _addr)

# OpenMP first (its passive wait, set above); TBB's spinning work-stealing pool last
if "NUMBA_THREADING_LAYER" not in os.environ and "NUMBA_THREADING_LAYER_PRIORITY" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]

_limits = None


def blas_name() -> str:
    """Which ``sgemm`` the kernels call (library, version, file and symbol, or the fallback)."""
    return _blas_desc


def default_num_threads() -> int:
    """The cores this process may run on (``os.sched_getaffinity``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


_threads: int | None = None  # set by numba_threads(): the count for every thread of the process


_count_getter = None   # the threading layer's C function for Numba's per-thread count


def _calling_thread_count() -> int:
    # numba.get_num_threads() once (it starts the pool), then the C function it calls after its
    # locks (numba.np.ufunc.parallel internals, checked against it; else the public call)
    global _count_getter
    if _count_getter is None:
        n = numba.get_num_threads()
        from numba.np.ufunc import parallel
        getter = getattr(parallel, "_get_num_threads", None)
        _count_getter = getter if getter is not None and getter() == n else numba.get_num_threads
        return n
    return _count_getter()


def num_threads() -> int:
    """Threads the CPU kernels' parallel regions use. Numba's own setting is per calling thread
    (a forward pass may run on an engine's background thread); a count set with
    ``numba_threads`` holds for every thread, and is applied to the calling thread here.

    Every kernel call asks, so it is read straight from the threading layer:
    ``numba.get_num_threads()`` takes two locks per call, costly when the caches are cold (a
    decode step streams megabytes of weights between two kernel calls)."""
    n = _calling_thread_count()
    if _threads is not None and n != _threads:
        numba.set_num_threads(_threads)
        n = _threads
    return n


_guard = None   # region_guard's answer, once the pool (and so the layer) is known


def region_guard():
    """The context every call into the kernels' compiled entry points runs in: a process-wide
    lock where Numba's threading layer is ``workqueue``, else nothing. Numba's parallel regions
    run without the GIL (and the entry points release it, ``nogil``), so two Python threads (two
    in-process engines) can launch parallel regions at once; OpenMP and TBB take that, but
    workqueue (Numba's choice where libgomp is missing) aborts the whole process ("Concurrent
    access has been detected"). Source: Numba's
    documentation, "The Threading Layers" (thread safety of each layer)."""
    global _guard
    if _guard is None:
        num_threads()   # starts the pool: the layer is known from then on
        _guard = threading.RLock() if numba.threading_layer() == "workqueue" else contextlib.nullcontext()
    return _guard


@contextlib.contextmanager
def numba_threads(n: int):
    """Run the CPU kernels on ``n`` threads inside the block, whichever thread calls them.

    Raises:
        ValueError: ``n`` is below 1 or above the pool's size (``NUMBA_NUM_THREADS``).
    """
    global _threads
    if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"{n} threads requested; the pool has {numba.config.NUMBA_NUM_THREADS} "
                         "(NUMBA_NUM_THREADS)")
    prev, prev_local = _threads, numba.get_num_threads()
    _threads = n
    numba.set_num_threads(n)
    try:
        yield
    finally:
        _threads = prev
        numba.set_num_threads(prev_local)


def apply_thread_policy() -> None:
    """Hold every BLAS pool loaded in this process at one thread (idempotent). Runs when this
    module is imported, i.e. whenever folio's CPU kernels are loaded.

    NumPy's own matrix products in this process then run on one thread too; folio's products
    go through ``kernels.cpu.linear``, which splits them over Numba's threads.
    """
    global _limits
    if _limits is None:
        from threadpoolctl import threadpool_limits
        _limits = threadpool_limits(limits=1, user_api="blas")


apply_thread_policy()
