"""Decode-sized products of two versions of ``kernels/cpu/linear.py``, interleaved in one process.

    python perf/linear_ab.py REV [--threads 1 2] [--rows 1 2 4 8 16 24]

``REV`` is a git revision whose ``kernels/cpu/linear.py`` is loaded beside the working tree's
(``folio.kernels.cpu.linear``). For each row count ``T``, both versions compute ``linear`` of a
``[T, K]`` input against each of the default model's four per-layer weights of all 30 layers in
turn (random weights, 426 MB: far beyond the last-level cache, so the weights come from memory),
alternately, 5 timed rounds after one untimed, best time each; printed: GB/s of weights read,
GFLOP/s (2 T flops per weight), the ratio new / old and the largest output difference. Only
figures of one run compare: the VM this project measures on drifts 10-30% between minutes.
"""

from __future__ import annotations

import argparse
import sys
import time

import numba
import numpy as np
from revision import load_kernel_module

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))  # perf.bench

import folio.kernels.cpu.linear as current
from perf.bench.kernel_rates import _model_weights


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 24])
    a = p.parse_args(argv)
    print("command: python " + " ".join(sys.argv), flush=True)
    old = load_kernel_module(a.rev, "linear")
    stacks = _model_weights(np.random.default_rng(0), 30)
    nbytes = sum(st.nbytes for st in stacks)
    for threads in a.threads:
        numba.set_num_threads(threads)
        for T in a.rows:
            xs = [np.random.default_rng(1).standard_normal((T, st.shape[2]), dtype=np.float32) for st in stacks]
            outs = {name: [np.empty((T, st.shape[1]), np.float32) for st in stacks] for name in ("old", "new")}
            best = {"old": 1e9, "new": 1e9}
            for rnd in range(6):            # the first round compiles and warms: not timed
                for name, mod in (("old", old), ("new", current)):
                    t0 = time.perf_counter()
                    for layer in range(stacks[0].shape[0]):
                        for x, st, out in zip(xs, stacks, outs[name]):
                            mod.linear(x, st[layer], out)
                    if rnd:
                        best[name] = min(best[name], time.perf_counter() - t0)
            err = max(float(np.abs(o - n).max()) for o, n in zip(outs["old"], outs["new"]))
            rate = {k: (nbytes / v / 1e9, 2 * T * nbytes / 4 / v / 1e9) for k, v in best.items()}
            print(f"T = {T:2d}, {threads} thread(s): old {rate['old'][0]:5.1f} GB/s {rate['old'][1]:6.1f} GFLOP/s, "
                  f"new {rate['new'][0]:5.1f} GB/s {rate['new'][1]:6.1f} GFLOP/s, x{best['old'] / best['new']:.2f}, "
                  f"max |diff| {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
