"""Large CPU buffers (KV caches, weights) on transparent huge pages.

A decode step reads every weight and, per sequence, that sequence's KV blocks, which lie anywhere
in the cache. With 4 KiB pages each block of the default model (16 tokens x 3 KV heads x 64 floats
= 12 KiB per layer for keys, as much for values) spans three pages, and a step of many sequences
touches thousands of pages: more than the TLB holds, so reads wait on page walks. A 2 MiB page
covers 170 such blocks. On the 2-vCPU EPYC this project measures on, decode attention read its
KV cache 6-17% faster from huge pages and a plain read of the same blocks 1-19% faster
(perf/RESULTS.md, seventh pass); the weight stream of decode-sized products gained 1-6%.

Linux hands out transparent huge pages (THP) to every anonymous mapping when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, and with ``madvise`` (the default
of many distributions, and of this machine) only to ranges marked ``madvise(MADV_HUGEPAGE)``;
NumPy's allocations are not marked. ``huge_page_zeros`` maps anonymous memory (zero-filled by
the kernel), aligns the array to 2 MiB and marks it. Where THP is off (``never``), madvise is
missing (not Linux) or refuses, the array is the same anonymous memory on normal pages: results
never depend on it. Arrays below ``HUGE_PAGE_MIN_BYTES`` use ``np.zeros``.

Sources: the Linux kernel's admin guide, "Transparent Hugepage Support" (modes ``always`` /
``madvise`` / ``never``, ``MADV_HUGEPAGE``); Python's ``mmap.madvise``.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["huge_page_zeros", "HUGE_PAGE_BYTES", "HUGE_PAGE_MIN_BYTES", "USE_HUGE_PAGES"]

HUGE_PAGE_BYTES = 2 << 20          # x86-64's transparent huge page size
HUGE_PAGE_MIN_BYTES = 2 << 20      # smaller arrays: np.zeros (less than one huge page to gain)
USE_HUGE_PAGES = True              # False: np.zeros always (benchmarks compare the two)


def huge_page_zeros(shape, dtype=np.float32) -> np.ndarray:
    """A zeroed C-contiguous array of ``shape`` and ``dtype``, 2 MiB-aligned and marked for
    transparent huge pages when it is at least ``HUGE_PAGE_MIN_BYTES`` (see the module docstring).

    The array owns its mapping (freed with the array). Raises what ``np.zeros`` raises for a bad
    shape or dtype.
    """
    dtype = np.dtype(dtype)
    shape = tuple(int(n) for n in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not USE_HUGE_PAGES or nbytes < HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.zeros(shape, dtype)
    # one huge page more than needed, so that a 2 MiB-aligned start lies inside the mapping
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(mm, np.uint8)       # holds the mapping alive as long as any view of it
    start = -raw.ctypes.data % HUGE_PAGE_BYTES
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:                      # THP off or unsupported: normal pages
            pass
    return raw[start:start + nbytes].view(dtype).reshape(shape)
