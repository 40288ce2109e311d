"""Numba's on-disk cache of the CPU kernels is keyed on the source of every kernel module
(kernels/cpu/jit_cache.py): a caller compiled against an old callee must not survive a change to it."""

from __future__ import annotations

import importlib.util
import os
import shutil

from folio.kernels.cpu import attention as cpu_attention
from folio.kernels.cpu import jit_cache
from folio.kernels.cpu import forward as cpu_forward
from folio.kernels.cpu import linear as cpu_linear
from folio.kernels.cpu import threads as cpu_threads


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_cached_kernel_carries_the_shared_stamp():
    stamp = ("folio-cpu-kernels", jit_cache.sources_digest())
    # the layer loop (which links kernels of four other files) and kernels of three other modules
    for fn in (cpu_forward._layers, cpu_linear.linear_into, cpu_attention._decode_item, cpu_threads._sgemm_fallback):
        assert fn._cache._impl.locator.get_source_stamp() == stamp, fn


def test_a_kernel_module_imported_first_carries_the_stamp():
    # in a fresh interpreter whose first kernel import is a module that does not import threads
    # (quant_x8, quant_int8): its kernels too carry the shared stamp, not Numba's own of their file
    import subprocess
    import sys
    code = ("from folio.kernels.cpu import quant_x8, quant_int8, jit_cache\n"
            "stamp = ('folio-cpu-kernels', jit_cache.sources_digest())\n"
            "for fn in (quant_x8.x8_rows, quant_x8.x8_decode_rows, quant_int8.quantize_once):\n"
            "    assert fn._cache._impl.locator.get_source_stamp() == stamp, fn\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-2000:]


def test_functions_outside_the_kernels_keep_numba_locators(tmp_path):
    src = tmp_path / "other_module.py"
    src.write_text("from numba import njit\n\n@njit(cache=True)\ndef f(x):\n    return x + 1\n")
    mod = _load(src, "other_module")
    locator = mod.f._cache._impl.locator
    assert not getattr(type(locator), "_folio_kernels", False)
    assert locator.get_source_stamp() != cpu_forward._layers._cache._impl.locator.get_source_stamp()
    assert mod.f(1) == 2


def test_a_covered_caller_is_keyed_on_the_kernels_and_its_own_source(tmp_path):
    # a module outside the kernels' folder that calls them (the benchmark regions of
    # perf.bench.kernel_rates): its entries must go stale when a kernel or it changes
    code = ("from folio.kernels.cpu import jit_cache, math as cpu_math\nfrom numba import njit\n"
            "jit_cache.cover(__file__)\n\n@njit(cache=True)\ndef f(x):\n    return cpu_math.exp2(x)\n")
    src = tmp_path / "caller_a.py"
    src.write_text(code)
    mod = _load(src, "caller_a")
    stamp = mod.f._cache._impl.locator.get_source_stamp()
    assert stamp[:2] == ("folio-cpu-kernels", jit_cache.sources_digest()) and len(stamp) == 3
    assert mod.f(3.0) == 8.0
    other = tmp_path / "caller_b.py"
    other.write_text(code + "# one more line\n")
    assert _load(other, "caller_b").f._cache._impl.locator.get_source_stamp() != stamp


def test_the_benchmark_regions_are_covered():
    import hashlib

    from perf.bench import kernel_rates
    own = hashlib.sha256(open(kernel_rates.__file__, "rb").read()).hexdigest()
    for fn in (kernel_rates._products_region, kernel_rates._attention_region):
        assert fn._cache._impl.locator.get_source_stamp() == jit_cache._STAMP + (own,), fn


def test_every_cached_function_outside_the_kernels_is_covered():
    # the package's modules and the benchmarks (perf/) that cache Numba functions outside the
    # kernels' folder must call cover()
    import folio
    import perf
    roots = [os.path.dirname(os.path.abspath(m.__file__)) for m in (folio, perf)]
    for folder, _, files in (entry for root in roots for entry in os.walk(root)):
        # (perf/llama.cpp/build: the peer's sources, unpacked by its Makefile, not the project's)
        if os.path.abspath(folder) == os.path.abspath(jit_cache._DIR) or "__pycache__" in folder or \
                os.path.join("llama.cpp", "build") in folder:
            continue
        for n in files:
            if n.endswith(".py"):
                text = open(os.path.join(folder, n)).read()
                if "cache=True" in text:
                    assert "jit_cache.cover(__file__)" in text, os.path.join(folder, n)


def test_a_change_to_any_kernel_module_changes_the_stamp(tmp_path, monkeypatch):
    src = jit_cache._DIR
    for name in jit_cache.KERNEL_MODULES:
        shutil.copy(f"{src}/{name}", tmp_path / name)
    monkeypatch.setattr(jit_cache, "_DIR", str(tmp_path))
    base = jit_cache.sources_digest()
    assert base == jit_cache._STAMP[1]  # the copies are the sources
    for name in jit_cache.KERNEL_MODULES:
        original = (tmp_path / name).read_bytes()
        (tmp_path / name).write_bytes(original + b"# one more line\n")
        assert jit_cache.sources_digest() != base, name
        (tmp_path / name).write_bytes(original)
    assert jit_cache.sources_digest() == base


def test_install_is_idempotent():
    from numba.core import caching
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    before = list(impl._locator_classes)
    jit_cache.install()
    assert impl._locator_classes == before
    assert sum(getattr(c, "_folio_kernels", False) for c in before) == len(before) // 2


def test_the_stamp_covers_every_module_that_compiles_with_numba():
    folder = jit_cache._DIR
    numba_modules = {n for n in os.listdir(folder) if n.endswith(".py")
                     and ("@njit" in open(os.path.join(folder, n)).read() or "@cfunc" in open(os.path.join(folder, n)).read())}
    assert numba_modules and numba_modules <= set(jit_cache.KERNEL_MODULES)


def test_kernels_import_where_no_cache_folder_is_writable():
    # A read-only install (the kernels' __pycache__ not writable) whose user has no writable home
    # (a hardened container: HOME=/nonexistent): every Numba locator refuses, and Numba raises
    # "cannot cache function ...: no locator available" when the kernels are defined, so folio
    # could not even import its CPU table. The kernels then cache in a private folder of the
    # process (compiled once per process) and run.
    import subprocess
    import sys
    code = """
from numba.core import caching
def read_only(self):
    raise PermissionError("read-only (test)")
for name in ("InTreeCacheLocator", "UserWideCacheLocator"):   # the kernels' __pycache__, ~/.cache/numba
    cls = getattr(caching, name, None) or getattr(caching, "_" + name)
    cls.ensure_cache_path = read_only
import numpy as np
from folio.kernels.cpu import table as cpu
from folio.kernels.cpu import forward as cpu_forward
x = np.ones((3, 8), np.float32)
assert np.array_equal(cpu.linear(x, np.eye(8, dtype=np.float32)), x)
print(cpu_forward._layers._cache._cache_path)
"""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    path = r.stdout.strip()
    assert path and not path.startswith(jit_cache._DIR) and not os.path.exists(path)  # removed at exit
