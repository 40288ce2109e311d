"""Large CPU arrays on transparent huge pages (kernels/cpu/memory.py): what the arrays are (zeroed,
aligned, owned), that the model's KV caches and weights get them, and that the kernel marks them
(checked in /proc/self/smaps where the machine has THP in ``madvise`` or ``always`` mode)."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from folio.kernels.cpu import memory as cpu_memory
from folio.kernels.cpu.memory import HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES, huge_page_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _smaps_entry(addr: int) -> dict:
    """The /proc/self/smaps fields of the mapping that holds ``addr``."""
    entry, hit = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            if hit:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = lo <= addr < hi
            continue
        if hit and ":" in head:
            parts = line.split()
            entry[head[:-1]] = parts[1:]
    return entry


@pytest.mark.parametrize("shape,dtype", [((3, 700, 1024), np.float32), ((HUGE_PAGE_MIN_BYTES // 2 + 7,), np.uint16),
                                         ((5, 7), np.float32), ((0, 4), np.float32)])
def test_arrays_are_zeroed_contiguous_writable_and_aligned_when_large(shape, dtype):
    a = huge_page_zeros(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype)
    assert a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    if a.nbytes >= HUGE_PAGE_MIN_BYTES:
        assert a.ctypes.data % HUGE_PAGE_BYTES == 0
    a[...] = 3
    assert (a == 3).all()
    b = huge_page_zeros(shape, dtype)          # a second array is its own memory
    assert not b.any()


def test_views_keep_the_mapping_alive():
    v = huge_page_zeros((4, HUGE_PAGE_MIN_BYTES // 16), np.float32)[1]
    gc.collect()
    v[:] = 1.5                                 # would fault if the mapping had been unmapped
    assert float(v.sum()) == 1.5 * v.size


def test_switched_off_gives_plain_numpy_arrays(monkeypatch):
    monkeypatch.setattr(cpu_memory, "USE_HUGE_PAGES", False)
    a = huge_page_zeros((4, HUGE_PAGE_MIN_BYTES), np.float32)
    assert a.base is None or isinstance(a.base, np.ndarray) and a.base.base is None
    assert not a.any()


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages off on this machine")
def test_the_kernel_marks_the_mapping_for_huge_pages():
    a = huge_page_zeros((16 * HUGE_PAGE_BYTES // 4,), np.float32)
    a[::1024] = 1.0                            # touch every page
    entry = _smaps_entry(a.ctypes.data)
    assert entry, "mapping not found in /proc/self/smaps"
    # "hg" in VmFlags: the range is madvise(MADV_HUGEPAGE)d (whether the kernel then found free
    # huge pages depends on the machine's fragmentation, so AnonHugePages is not asserted)
    assert "hg" in entry.get("VmFlags", []), entry.get("VmFlags")


def test_model_kv_caches_and_weights_use_the_tables_allocator(monkeypatch):
    from folio.kernels.cpu.table import CPU_KERNELS, prepare_weight
    from folio.model.config import ModelConfig
    from folio.model.loader import allocate_kv_caches
    seen = []

    def spy(shape, dtype=np.float32):
        seen.append(tuple(shape))
        return huge_page_zeros(shape, dtype)
    monkeypatch.setattr(CPU_KERNELS, "zeros", spy)
    cfg = ModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=100, max_position_embeddings=64)
    caches = allocate_kv_caches(cfg, 8, 16, CPU_KERNELS)
    assert seen == [(8, 16, 2, 16)] * 4 and len(caches) == 2
    w = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    p = prepare_weight(w)
    assert p.ctypes.data % HUGE_PAGE_BYTES == 0 and np.array_equal(p, w)


def test_madvise_refused_gives_the_same_array_on_normal_pages(monkeypatch):
    """THP ``never`` (or a kernel without MADV_HUGEPAGE): madvise raises OSError; the array is
    still zeroed, aligned, writable and its own memory, only not marked for huge pages."""
    import mmap

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    fake = type(mmap)("mmap")
    fake.__dict__.update({k: v for k, v in vars(mmap).items() if not k.startswith("__")})
    fake.mmap = Refusing
    monkeypatch.setattr(cpu_memory, "mmap", fake)
    a = huge_page_zeros((3, HUGE_PAGE_BYTES // 4 + 5), np.float32)
    assert a.shape == (3, HUGE_PAGE_BYTES // 4 + 5) and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % HUGE_PAGE_BYTES == 0 and not a.any()
    a[::2] = 7
    assert (a[::2] == 7).all() and not a[1].any()
    if _thp_mode() is not None:
        a[:, ::1024] = 1.0
        assert "hg" not in _smaps_entry(a.ctypes.data).get("VmFlags", [])


def _resident_kib(path: Path) -> int:
    # this process's resident KiB of the mapping of ``path`` (/proc/self/smaps)
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_release_mapped_pages_drops_a_read_only_mapping_and_keeps_its_data(tmp_path):
    import mmap
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, size=64 * mmap.PAGESIZE, dtype=np.uint8)
    data.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    view = np.asarray(mapped[100:100 + 40 * mmap.PAGESIZE]).reshape(40, -1)   # as gguf_weights makes them
    assert int(view.sum(dtype=np.int64)) == int(data[100:100 + 40 * mmap.PAGESIZE].sum(dtype=np.int64))
    before = _resident_kib(path)
    released = cpu_memory.release_mapped_pages(view)
    assert released == 39 * mmap.PAGESIZE          # the whole pages inside the view, not its edges
    assert _resident_kib(path) <= before - released // 1024
    np.testing.assert_array_equal(view.reshape(-1), data[100:100 + 40 * mmap.PAGESIZE])   # read again: the same
    # memory the process owns is never advised (the advice would zero it)
    owned = data.copy()
    assert cpu_memory.release_mapped_pages(owned) == 0
    np.testing.assert_array_equal(owned, data)
    writable = np.memmap(path, dtype=np.uint8, mode="r+")
    assert cpu_memory.release_mapped_pages(np.asarray(writable[:8 * mmap.PAGESIZE])) == 0
    del mapped, writable
