"""The CPU threading policy (kernels/cpu/threads.py): one pool, BLAS held at one thread, work
items from a shared counter, and the sgemm the kernels call (BLAS's or the fallback loop)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from numba import njit, prange
from support import ROOT, TESTS_DIR
from support.numerics import dot_bound

from folio.kernels.cpu import table as cpu
from folio.kernels.cpu import linear as cpu_linear
from folio.kernels.cpu import simd as cpu_simd
from folio.kernels.cpu import threads as cpu_threads
from folio.kernels.cpu.threads import NO_TRANS, ROW_MAJOR, TRANS, fetch_add


def _fallback():
    i64, f32, vp = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    proto = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, i64, f32, vp, i64, vp, i64, f32,
                             vp, i64)
    return proto(cpu_threads._sgemm_fallback.address)


@pytest.mark.parametrize("ta", [NO_TRANS, TRANS])
@pytest.mark.parametrize("tb", [NO_TRANS, TRANS])
def test_sgemm_fallback_is_cblas_sgemm(ta, tb):
    # the loop that stands in for BLAS where NumPy's has no ILP64 cblas_sgemm: same contract,
    # C = alpha op(A) op(B) + beta C, row-major with leading dimensions wider than the operands
    rng = np.random.default_rng(0)
    M, N, K, pad = 5, 7, 11, 3
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    A = np.zeros((M, K + pad) if ta == NO_TRANS else (K, M + pad), np.float32)
    B = np.zeros((K, N + pad) if tb == NO_TRANS else (N, K + pad), np.float32)
    if ta == NO_TRANS:
        A[:, :K] = a
    else:
        A[:, :M] = a.T
    if tb == NO_TRANS:
        B[:, :N] = b
    else:
        B[:, :K] = b.T
    C = rng.standard_normal((M, N + pad)).astype(np.float32)
    want = 2.0 * (a.astype(np.float64) @ b) + 0.5 * C[:, :N]
    _fallback()(ROW_MAJOR, ta, tb, M, N, K, 2.0, A.ctypes.data, A.shape[1], B.ctypes.data, B.shape[1], 0.5,
                C.ctypes.data, C.shape[1])
    # alpha (exact: 2) times a K-term dot product, plus beta C (two more roundings)
    bound = 2 * dot_bound(a, b.T) + 4 * 2.0 ** -24 * (2 * np.abs(a) @ np.abs(b) + np.abs(want))
    assert np.all(np.abs(C[:, :N] - want) <= bound)


def test_blas_is_held_at_one_thread_and_named():
    from threadpoolctl import threadpool_info
    blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
    assert blas and all(i["num_threads"] == 1 for i in blas), blas
    assert cpu_threads.blas_name()


def test_every_work_item_is_taken_exactly_once():
    @njit(parallel=True)
    def claim(n_items, n_tasks, counter, seen):
        for _task in prange(n_tasks):
            while True:
                i = fetch_add(counter, 1)
                if i >= n_items:
                    break
                seen[i] += 1

    seen = np.zeros(10007, np.int64)
    claim(seen.size, max(2, numba.get_num_threads()), np.zeros(1, np.int64), seen)
    assert np.all(seen == 1)


def test_numba_threads_sets_and_restores():
    before = numba.get_num_threads()
    with cpu_threads.numba_threads(1):
        assert cpu_threads.num_threads() == 1
    assert numba.get_num_threads() == before
    for bad in (0, numba.config.NUMBA_NUM_THREADS + 1):
        with pytest.raises(ValueError, match="threads"):
            with cpu_threads.numba_threads(bad):
                pass


def test_numba_threads_holds_for_other_threads():
    # an engine's background thread (overlap scheduling) runs the forward pass: the count set by
    # numba_threads must reach it, though Numba's own setting is per thread
    import threading
    seen = []
    with cpu_threads.numba_threads(1):
        t = threading.Thread(target=lambda: seen.append(cpu_threads.num_threads()))
        t.start()
        t.join()
    assert seen == [1]


@pytest.mark.parametrize("cores,env,want", [("all", None, "all"), ("one", None, 1), ("one", "3", 3)],
                         ids=["every allowed core", "a one-core affinity", "NUMBA_NUM_THREADS wins"])
def test_kernels_default_to_every_allowed_core_unless_numba_num_threads(cores, env, want):
    # the count the kernels' parallel regions run on (num_threads(), asked at every kernel call) in
    # a fresh process, as an engine starts: every core the process may run on (its affinity, not
    # the machine's core count), unless NUMBA_NUM_THREADS says otherwise, even above the cores
    allowed = sorted(os.sched_getaffinity(0))
    mask = set(allowed) if cores == "all" else {allowed[0]}
    environ = {k: v for k, v in os.environ.items() if k != "NUMBA_NUM_THREADS"}
    if env is not None:
        environ["NUMBA_NUM_THREADS"] = env
    code = "from folio.kernels.cpu import threads; print(threads.num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, mask)).stdout
    assert int(out) == (len(allowed) if want == "all" else want)


@pytest.mark.parametrize("preset", [None, "active"])
def test_openmp_waits_passively_unless_the_user_says(preset):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_WAIT_POLICY_SET_BY_FOLIO")}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    code = "import os, folio.kernels.cpu.table; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == (preset or "passive")


def test_linear_tiles_cover_the_output(monkeypatch):
    # several row and column tiles, ragged edges, against the exact product (any order of sums)
    monkeypatch.setattr(cpu_linear, "_PARALLEL_MIN_WEIGHTS", 0)
    rng = np.random.default_rng(1)
    w = rng.standard_normal((200, 70)).astype(np.float32)
    # streamed weight-row blocks (passes of 4, 2, 1 tokens); above GEMV_MAX_ROWS streamed tiles
    # of equal token chunks (STREAM_TILES, AVX-512: 130 = 44 + 43 + 43) or sgemm tiles
    for T in (7, 9, 130, 600):
        x = rng.standard_normal((T, 70)).astype(np.float32)
        with cpu_threads.numba_threads(min(2, numba.config.NUMBA_NUM_THREADS)):
            y = cpu.linear(x, w)
        assert np.all(np.abs(y - x.astype(np.float64) @ w.astype(np.float64).T) <= dot_bound(x, w))
    # both ways to cut a product above GEMV_MAX_ROWS rows, whichever linear_plan picks here
    # (streamed tiles where the streaming kernel takes 64 tokens and BLAS runs no AVX-512
    # kernels): streamed tiles (tile_m 0), sgemm tiles, each on 1 task and on 2
    for T in (cpu_linear.GEMV_MAX_ROWS + 1, 130, 600):
        x = rng.standard_normal((T, 70)).astype(np.float32)
        for plan in ((1, 0, 0), (2, 0, 0), (1, T, 200), (2,) + cpu_linear.gemm_tiles(T, 200, 2)):
            y = np.full((T, 200), np.nan, np.float32)
            with cpu_threads.numba_threads(min(2, numba.config.NUMBA_NUM_THREADS)):
                cpu_linear.linear_into(x, w, y, *plan)
            assert np.all(np.abs(y - x.astype(np.float64) @ w.astype(np.float64).T) <= dot_bound(x, w)), (T, plan)
    tile_m, tile_n = cpu_linear.gemm_tiles(600, 200, 2)
    assert 64 <= tile_m <= 512 and tile_n % 16 == 0 and -(-600 // tile_m) * -(-200 // tile_n) >= 4 * 2
    # as square as the output allows: a 512-token batch against 576 weight rows is not cut into
    # whole-row tiles of 80 weight rows (each sgemm call would pack all 512 rows of x)
    assert cpu_linear.gemm_tiles(512, 576, 2) == (256, 144)


def test_kernels_run_on_the_fallback_sgemm():
    # a process without BLAS's sgemm (FOLIO_CPU_SGEMM=fallback): the tiled products and the
    # prefill attention tiles run on the Numba loop, within the same derived bounds
    code = """
import numpy as np
from support.kernel_cases import paged_attention_case
from support.numerics import attention_bound, dot_bound
from folio.kernels.cpu import table as cpu
from folio.kernels.cpu import threads as cpu_threads
from folio.kernels import reference
assert cpu_threads.blas_name().startswith("Numba loop fallback"), cpu_threads.blas_name()
case = paged_attention_case(7, [(90, 60), (40, 1)], num_heads=9, num_kv_heads=3, head_dim=64)
err = np.abs(cpu.paged_attention(**case).astype(np.float64) - reference.paged_attention(**case))
assert np.all(err <= attention_bound(case))
rng = np.random.default_rng(0)
x, w = rng.standard_normal((40, 70)).astype(np.float32), rng.standard_normal((50, 70)).astype(np.float32)
assert np.all(np.abs(cpu.linear(x, w) - x.astype(np.float64) @ w.astype(np.float64).T) <= dot_bound(x, w))
print("ok")
"""
    env = dict(os.environ, FOLIO_CPU_SGEMM="fallback", PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS_DIR)]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.skipif(not cpu_simd.compiles_avx512(), reason="the suite itself runs the AVX2 configuration here")
def test_kernels_compiled_for_avx2(tmp_path):
    # the streaming kernel's shape (cpu_linear.TOKENS_PER_PASS, GEMV_MAX_ROWS) and the vector
    # width of the decode attention's block code (cpu_simd.W) follow the vector registers the
    # kernels are compiled for; on an AVX-512 machine the suite runs the wide configuration, so
    # here the kernels are compiled for AVX2 (Haswell's features, no AVX-512) in a fresh
    # interpreter with its own cache. Products: every T to past its bound, on one thread and on
    # two (a weight large enough for the parallel blocks), against the exact product. Decodes
    # and prefill tiles: head_dim 24 (a multiple of 8 lanes, not of 16: the vector code only
    # here), 64 and 128 (sgemm tiles with 8 lanes), block sizes 16 and 32, against the
    # reference within its bound.
    code = """
import numpy as np
from support.kernel_cases import paged_attention_case
from support.numerics import attention_bound, dot_bound
from folio.kernels.cpu import table as cpu
from folio.kernels.cpu import linear as cpu_linear
from folio.kernels.cpu import simd as cpu_simd
from folio.kernels.cpu import threads as cpu_threads
from folio.kernels import reference
assert (cpu_linear.TOKENS_PER_PASS, cpu_linear.GEMV_MAX_ROWS, cpu_simd.W) == (2, 24, 8)
for seed, (D, bs) in enumerate(((24, 16), (64, 32), (128, 16))):
    case = paged_attention_case(seed, [(300, 1), (47, 3), (16, 1), (33, 2), (150, 150), (200, 41)], num_heads=6,
                                num_kv_heads=2, head_dim=D, block_size=bs)
    err = np.abs(cpu.paged_attention(**case) - reference.paged_attention(**case))
    assert np.all(err <= attention_bound(case)), (D, bs)
rng = np.random.default_rng(0)
for threads, (N, K) in ((1, (50, 70)), (2, (130, 520))):
    assert N * K >= cpu_linear._PARALLEL_MIN_WEIGHTS or threads == 1
    w = rng.standard_normal((N, K)).astype(np.float32)
    with cpu_threads.numba_threads(threads):
        for T in range(1, 27):
            x = rng.standard_normal((T, K)).astype(np.float32)
            y = cpu.linear(x, w)
            assert np.all(np.abs(y - x.astype(np.float64) @ w.astype(np.float64).T) <= dot_bound(x, w)), (threads, T)
print("ok")
"""
    path = os.pathsep.join([str(ROOT), str(TESTS_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt",
               NUMBA_CACHE_DIR=str(tmp_path), PYTHONPATH=path)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_concurrent_forwards_on_the_workqueue_layer():
    # Numba's parallel regions run without the GIL (the compiled entry points release it too), so
    # two Python threads (two in-process engines, each forwarding on its own thread) can launch
    # parallel regions at once (main at cdc362a, before nogil, aborted here as well). Numba's
    # workqueue layer, the one it falls back to where libgomp is missing, aborts the whole
    # process on concurrent launches; OpenMP and TBB take them. On workqueue the kernels must
    # serialise their regions: results equal to one thread's, exit code 0.
    code = """
import threading
import numpy as np
from types import SimpleNamespace
from folio.kernels.cpu import table as cpu
from folio.kernels import get_kernels
from folio.kernels.cpu.threads import numba_threads
from folio.model.attention_metadata import AttentionMetadata
from folio.model.config import ModelConfig
from folio.model.llama import LlamaForCausalLM
from folio.model.loader import allocate_kv_caches
from folio.model.weights import dummy_weights
import numba
c = ModelConfig(vocab_size=97, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=True)
w = dummy_weights(c, seed=1)
fused = LlamaForCausalLM(c, w, get_kernels("cpu"))   # decoder_layers
loop = LlamaForCausalLM(c, w, SimpleNamespace(**{**vars(get_kernels("cpu")), "stacked_layers": False}))   # one by one
T = 200
ids, pos = np.arange(T, dtype=np.int64) % 97, np.arange(T, dtype=np.int64)
md = AttentionMetadata(pos.copy(), np.array([0, T], np.int32), np.array([T], np.int32),
                       np.arange(13, dtype=np.int32)[None], T, T)
def forward(m):
    return m.forward(ids, pos, md, allocate_kv_caches(c, 13, 16, m.kernels), np.arange(T))
with numba_threads(2):
    want = forward(fused)
    got = {0: [], 1: []}
    ths = [threading.Thread(target=lambda i=i, m=m: got[i].extend(forward(m) for _ in range(15)))
           for i, m in enumerate((fused, loop))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
assert numba.threading_layer() == "workqueue", numba.threading_layer()
assert all(np.array_equal(g, want) for g in got[0] + got[1]) and len(got[0]) == len(got[1]) == 15
print("ok")
"""
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
