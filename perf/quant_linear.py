"""Decode-sized products from GGUF-quantized weights against the float32 streaming kernel.

    python -m perf.quant_linear [--shapes 1b-up default-up default-down] [--types Q8_0 Q4_1 Q4_K Q6_K]
                                 [--rows 1 4 8] [--threads 1 N] [--rounds 3] [--activations float32 int8]

For each projection shape ``(K, N)`` (Llama-3.2-1B's: ``1b-q`` K = N = 2048, ``1b-kv`` N = 512,
``1b-up`` N = 8192, ``1b-down`` K = 8192, N = 2048, ``1b-lm-head`` N = 128256; the default
model's, SmolLM2-135M: ``default-q`` K = N = 576, ``default-kv`` N = 192, ``default-up`` N =
1536, ``default-down`` K = 1536, N = 576), each weight type, ``T`` tokens, thread count and
activation type (``float32``: dequantized in registers; ``int8``: quantized per 32 values, integer
dot products, ``quant_linear(..., activations="int8")``): ``quant_linear``
(``kernels/cpu/quant_linear.py``) on random weights of that type and ``linear``
(``kernels/cpu/linear.py``) on the same values in float32. The weight is copied
until the float32 copies pass 256 MB (the quantized copies take the same number), and each timed
round runs every copy once, so the weights come from memory, not the last-level cache, as in a
model's decode step. Printed per line: GB/s of weight bytes read, products per second as
tokens/s (``T`` / the time of one product), and the ratio of the float32 kernel's time to this
type's; then the same per second of CPU time (process time, all threads, scaled by the thread
count: what the wall clock would show with the cores to itself, on a machine shared with other
work). Best of ``--rounds`` rounds after one untimed (compilation, warm-up). A type whose
blocks do not divide ``K`` (the K-quants at K = 576) is skipped, as GGUF files do (llama.cpp
stores such tensors in another type). Figures taken on a shared machine are noisy: compare only
within one run.
"""

from __future__ import annotations

import argparse
import sys
import time

import numba
import numpy as np

from folio.kernels import quant_reference as qr
from folio.kernels.cpu import linear as cpu_linear
from folio.kernels.cpu import quant_int8 as qi
from folio.kernels.cpu import quant_linear as ql
from folio.kernels.cpu import simd
from folio.kernels.cpu.threads import numba_threads
from perf.bench.common import machine_info

SHAPES = {"1b-q": (2048, 2048), "1b-kv": (2048, 512), "1b-up": (2048, 8192), "1b-down": (8192, 2048),
          "1b-lm-head": (2048, 128256), "default-q": (576, 576), "default-kv": (576, 192), "default-up": (576, 1536),
          "default-down": (1536, 576)}
_TARGET_BYTES = 256 << 20


def _time(fn, copies, rounds):
    # (wall, CPU) seconds of one product: the best round of each; CPU time is the whole process's
    # (every thread), which a shared machine disturbs less than the wall clock when this process
    # waits for a core
    best, best_cpu = float("inf"), float("inf")
    for rnd in range(rounds + 1):          # round 0 compiles and warms: not timed
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(copies):
            fn(i)
        if rnd:
            best = min(best, (time.perf_counter() - t0) / copies)
            best_cpu = min(best_cpu, (time.process_time() - c0) / copies)
    return best, best_cpu


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1b-up", "default-up", "default-down"], choices=sorted(SHAPES))
    p.add_argument("--types", nargs="+", default=["Q8_0", "Q4_1", "Q4_K", "Q6_K", "Q5_K", "Q4_0", "F16", "BF16"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--threads", type=int, nargs="+", default=[1, numba.config.NUMBA_NUM_THREADS])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--activations", nargs="+", default=["float32", "int8"], choices=list(ql.ACTIVATIONS))
    a = p.parse_args(argv)
    info = machine_info()
    print("command: python -m perf.quant_linear " + " ".join(sys.argv[1:]), flush=True)
    print(f"cpu: {info.get('cpu', '?')}, {info.get('cores')} cores, load {info.get('loadavg_1m', '?')}; integer "
          f"products compiled for {qi.ISA}, float32 vectors of {simd.W} lanes", flush=True)
    rng = np.random.default_rng(0)
    for shape in a.shapes:
        K, N = SHAPES[shape]
        values = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        copies = max(1, -(-_TARGET_BYTES // values.nbytes))
        f32 = [values.copy() for _ in range(copies)]
        weights = {}
        for name in a.types:
            q = qr.quant_type(name)
            if K % q.block_values:
                print(f"{shape} K={K} N={N}: {name} skipped (K is not a whole number of {q.block_values}-value blocks)")
                continue
            if name in qr.QUANTIZERS:
                one = qr.quantize(values, name)
            else:   # no quantizer here (Q5_K, Q6_K): random blocks of the type, small scales
                nb = K // q.block_values
                raw = rng.integers(0, 256, (N * nb, q.block_bytes), dtype=np.uint8)
                for _n, off, _ln, kind in q.fields:
                    if kind == "f16":
                        raw[:, off:off + 2] = rng.uniform(-1e-3, 1e-3, (N * nb, 1)).astype("<f2").view(np.uint8)
                one = raw.reshape(N, nb * q.block_bytes)
            weights[name] = [one.copy() for _ in range(copies)]
        print(f"{shape} K={K} N={N}: {copies} copies of each weight (float32 {copies * values.nbytes / 2**20:.0f} MB)",
              flush=True)
        for threads in a.threads:
            with numba_threads(threads):
                for T in a.rows:
                    x = rng.standard_normal((T, K)).astype(np.float32)
                    out = np.empty((T, N), np.float32)
                    t_ref, c_ref = _time(lambda i: cpu_linear.linear(x, f32[i], out), copies, a.rounds)
                    print(f"  {threads} thread(s) T={T}: float32  {values.nbytes / t_ref / 1e9:6.2f} GB/s "
                          f"{T / t_ref:9.0f} tok/s  (per CPU second: {T * threads / c_ref:9.0f} tok/s)", flush=True)
                    for name, ws in weights.items():
                        q = qr.quant_type(name)
                        for act in a.activations:
                            if act != "float32" and ql.quant_kernel_type(q, act) == q.id:
                                continue   # no integer path for this type (or this CPU)
                            t, c = _time(lambda i: ql.quant_linear(x, ws[i], q.id, out, activations=act), copies,
                                         a.rounds)
                            print(f"  {threads} thread(s) T={T}: {name:7s} {act:7s}  {ws[0].nbytes / t / 1e9:6.2f} "
                                  f"GB/s {T / t:9.0f} tok/s  x{t_ref / t:.2f} vs float32  (per CPU second: "
                                  f"{T * threads / c:9.0f} tok/s, x{c_ref / c:.2f})", flush=True)


if __name__ == "__main__":
    main()
