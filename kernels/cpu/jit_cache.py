"""Numba's on-disk cache of the CPU kernels, keyed on the source of every kernel module.

``@njit(cache=True)`` stores machine code beside each module (``__pycache__``) and reuses it
while the function's *own* source file is unchanged: Numba does not look at the files of the
functions it calls. The CPU kernels call across files (``forward.py``'s layer loop links the
products of ``linear.py``, the attention of ``attention.py``, the row kernels of ``rows.py``, all of
them ``math.py``'s ``exp2`` and ``threads.py``' atomics), so a change to one of them (an upgrade, a
checkout) would leave its callers running machine code built from the old source (a cached layer
loop keeping an old ``linear.GEMV_MAX_ROWS``). Here every CPU kernel module's cache entries carry
one stamp, the SHA-256 of all those modules' source, so a change to any of them recompiles all of
them. A module outside this folder whose cached functions call the kernels
(``perf.bench.kernel_rates``' regions) asks for the same with ``cover(__file__)`` before it defines
them: its entries then carry the stamp and the digest of its own source.

How: Numba picks a cache locator per function from ``CacheImpl._locator_classes`` (its own
classes: ``NUMBA_CACHE_DIR``, beside the source, the user-wide cache, ...); ``install`` puts in
front of them a subclass of each that answers only for this folder's modules and returns the
shared stamp from ``get_source_stamp``, so where the cache lives stays Numba's choice. Behind
Numba's own comes a last resort for the kernels, a private temporary folder of the process
(``_ProcessCacheLocator``): where nothing else is writable (a read-only install whose user has no
writable home) Numba would raise when a kernel is defined. A user's
own ``NUMBA_CACHE_LOCATOR_CLASSES`` replaces the list and this with it. Imported (and installed)
by this package's ``__init__`` (and ``threads.py``), so before any kernel module defines a kernel.

Source: Numba's documentation, "Cache invalidation" (numba.readthedocs.io, notes on caching:
changes in other files are not tracked) and ``numba/core/caching.py``.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile

from numba.core import caching

__all__ = ["install", "cover", "sources_digest", "KERNEL_MODULES"]

_DIR = os.path.dirname(os.path.abspath(__file__))
KERNEL_MODULES = tuple(sorted(n for n in os.listdir(_DIR) if n.endswith(".py") and n != "__init__.py"))
"""The files whose compiled functions share one cache stamp: every ``*.py`` of this folder,
``kernels/cpu/`` (a new kernel module is included by being here)."""


def sources_digest() -> str:
    """SHA-256 (hex) of the names and contents of ``KERNEL_MODULES``."""
    h = hashlib.sha256()
    for name in KERNEL_MODULES:
        with open(os.path.join(_DIR, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


_STAMP = ("folio-cpu-kernels", sources_digest())
_COVERED: dict[str, tuple] = {}   # absolute path of a covered caller module -> its stamp


def cover(py_file: str) -> tuple:
    """Key the cached Numba functions of ``py_file`` (a module outside this folder that calls the
    kernels; call this before its ``@njit(cache=True)`` definitions) on the kernels' sources and
    its own: returns its stamp, ``_STAMP`` plus the SHA-256 of the file. Raises OSError if the
    file cannot be read."""
    path = os.path.abspath(py_file)
    with open(path, "rb") as f:
        _COVERED[path] = _STAMP + (hashlib.sha256(f.read()).hexdigest(),)
    return _COVERED[path]


def _for_kernels(locator_cls):
    """``locator_cls`` narrowed to this folder's modules, with the shared stamp."""

    class KernelsLocator(locator_cls):
        @classmethod
        def from_function(cls, py_func, py_file):
            path = os.path.abspath(py_file)
            if os.path.dirname(path) != _DIR and path not in _COVERED:
                return None
            self = super().from_function(py_func, py_file)
            if self is not None:
                self._folio_stamp = _COVERED.get(path, _STAMP)
            return self

        def get_source_stamp(self):
            return self._folio_stamp

    KernelsLocator.__name__ = KernelsLocator.__qualname__ = "FolioKernels" + locator_cls.__name__
    return KernelsLocator


_UserProvided = getattr(caching, "UserProvidedCacheLocator", None) or getattr(caching, "_UserProvidedCacheLocator")


class _ProcessCacheLocator(_UserProvided):
    """Numba's ``NUMBA_CACHE_DIR`` locator on a folder of this process (``mkdtemp``: private,
    removed at exit): the kernels then compile once per process instead of failing to import."""
    folder = None

    def __init__(self, py_func, py_file):
        if _ProcessCacheLocator.folder is None:
            _ProcessCacheLocator.folder = tempfile.mkdtemp(prefix="numba-folio-")
            atexit.register(shutil.rmtree, _ProcessCacheLocator.folder, True)
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(_ProcessCacheLocator.folder, self.get_suitable_cache_subpath(py_file))

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            self = cls(py_func, py_file)
            self.ensure_cache_path()
        except OSError:
            return None
        return self


def install() -> None:
    """Put the kernel-folder locators in front of Numba's own and the process folder behind them
    (idempotent)."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    classes = list(impl._locator_classes)
    if any(getattr(c, "_folio_kernels", False) for c in classes):
        return
    ours = []
    for c in classes:
        k = _for_kernels(c)
        k._folio_kernels = True
        ours.append(k)
    impl._locator_classes = ours + classes + [_for_kernels(_ProcessCacheLocator)]


install()
