"""The tiled sgemm products of kernels/cpu/linear.py at decode-batch size (T = 64 rows), at 1
thread (one call) and at 2 threads with several tilings: GFLOP/s, best of 30 calls.

Used for issue 9's thread-scaling analysis (perf/RESULTS.md): the same tiles measured minutes
apart show how much the machine's second core delivers from one minute to the next.

Run: ``.venv/bin/python perf/gemm_tiles.py``
"""

import sys
import time

import numpy as np

from folio.kernels.cpu import linear as L
from folio.kernels.cpu.threads import apply_thread_policy, numba_threads


def gflops(T, N, K, tile_m, tile_n, threads, rep=30, rng=np.random.default_rng(0)):
    x = rng.standard_normal((T, K), dtype=np.float32)
    w = rng.standard_normal((N, K), dtype=np.float32)
    out = np.empty((T, N), np.float32)
    with numba_threads(threads):
        times = []
        for i in range(rep + 3):
            t0 = time.perf_counter()
            L._linear_parallel(x, w, out, tile_m, tile_n, threads, np.zeros(1, np.int64))
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return 2 * T * N * K / min(times) / 1e9


def main():
    apply_thread_policy()
    print("command:", "python " + " ".join(sys.argv))
    T = 64
    for name, N, K in [("qkv_proj", 960, 576), ("down_proj", 576, 1536), ("o_proj", 576, 576),
                       ("gate_up_proj", 3072, 576)]:
        tilings = [(T, L.gemm_tiles(T, N, 2)[1]), (T, -(-N // 2)), (T, -(-N // 4)), (32, N)]
        two = ", ".join(f"{m}x{n}: {gflops(T, N, K, m, n, 2):.1f}" for m, n in tilings)
        print(f"{name} [{T} x {K}] x [{K} x {N}]: 1 thread {gflops(T, N, K, T, N, 1):.1f} GFLOP/s | 2 threads {two}")


if __name__ == "__main__":
    main()
