"""Large CPU buffers (KV caches, weights) on transparent huge pages, every byte of them.

A decode step reads every weight and, per sequence, that sequence's KV blocks, which lie anywhere
in the cache. With 4 KiB pages each block of the default model (16 tokens x 3 KV heads x 64 floats
= 12 KiB per layer for keys, as much for values) spans three pages, and a step of many sequences
touches more pages than the TLB holds; the hardware prefetchers also stop at page ends. A 2 MiB
page covers 170 such blocks.

Linux hands out transparent huge pages (THP) to every anonymous mapping when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always``, and with ``madvise`` (the default
of many distributions, and of this machine) only to ranges marked ``madvise(MADV_HUGEPAGE)``.
NumPy marks its own allocations of 4 MiB and more (``NUMPY_MADVISE_HUGEPAGE``, on by default for
Linux 4.6+), but the kernel can only use the whole 2 MiB-aligned pages inside a marked range: an
array below 4 MiB gets none, and the head and tail of every array (up to 2 MiB each) stay on 4 KiB
pages. ``huge_page_zeros`` maps anonymous memory (zero-filled by the kernel), starts the array on a
2 MiB boundary and marks it from 2 MiB up, so all of it can be huge pages. What that gains depends
on how much NumPy leaves uncovered: most for caches of a few MB per layer, little for hundreds.

Where THP is off (``never``), madvise is missing (not Linux) or refuses, the array is the same
anonymous memory on normal pages: results never depend on it. Arrays below
``HUGE_PAGE_MIN_BYTES`` use ``np.zeros``.

``release_mapped_pages``: a weight the kernels read in another layout (``quant_linear.kernel_layout``)
is copied once; where the original is a view of a read-only mapped file (a GGUF served in place),
its whole pages are dropped from the process (``MADV_DONTNEED``: for a shared file mapping the
pages stay in the page cache and a later read maps them again, unchanged), so the copy does not
double the weights' share of the resident set.

Sources: the Linux kernel's admin guide, "Transparent Hugepage Support" (modes ``always`` /
``madvise`` / ``never``, ``MADV_HUGEPAGE``); NumPy's "Global state" page (madvise hugepage on
Linux); Python's ``mmap.madvise``.
"""

from __future__ import annotations

import mmap

import numpy as np

__all__ = ["huge_page_zeros", "release_mapped_pages", "HUGE_PAGE_BYTES", "HUGE_PAGE_MIN_BYTES", "USE_HUGE_PAGES"]

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


def release_mapped_pages(array: np.ndarray) -> int:
    """Drop the whole pages of ``array`` from this process's resident set where ``array`` is a view
    of a read-only ``np.memmap`` (``madvise(MADV_DONTNEED)``; the file's data is unchanged and a
    later read maps it again). Any other array (owned memory, a writable mapping) is left alone:
    there the advice would discard data. Returns the bytes advised (0 where nothing was)."""
    base = array
    while base is not None and not isinstance(base, np.memmap):
        base = getattr(base, "base", None)
    mm = getattr(base, "_mmap", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if base is None or getattr(base, "mode", None) != "r" or not isinstance(mm, mmap.mmap) or advice is None:
        return 0
    start = np.frombuffer(mm, np.uint8).ctypes.data
    off = array.ctypes.data - start
    if off < 0 or off + array.nbytes > len(mm):
        return 0
    a = -(-off // mmap.PAGESIZE) * mmap.PAGESIZE
    e = (off + array.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if e <= a:
        return 0
    try:
        mm.madvise(advice, a, e - a)
    except OSError:
        return 0
    return e - a
