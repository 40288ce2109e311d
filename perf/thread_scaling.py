"""Thread scaling of folio on the throughput workload, 1 thread and all cores alternating.

    python perf/thread_scaling.py [--rounds 3] [--threads 1 2] [--num-prompts 64]

Each round runs ``folio bench throughput --threads T --json ...`` once per thread count, each in
its own process (the command sizes its thread pools at start), the order reversed every other
round so that a drift of the machine's speed does not favour one count. Printed per round:
output tokens/s at each count, the ratio of the last count to the first, and the forward time
split into the steps that carry prompt tokens (compute-bound products) and the decode-only steps
(every sequence one token: weights and KV cache read from memory), with their ratios; then the
median ratio and the 1-minute load before each run. The VM this project measures on drifts
10-30% between minutes, so one pair of runs minutes apart (as in a report) does not measure
scaling; adjacent runs, repeated, do (perf/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run_once(threads: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="folio-scaling-") as tmp:
        path = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "folio", "bench", "throughput", "--threads", str(threads), "--no-progress",
               "--num-prompts", str(args.num_prompts), "--input-len", *map(str, args.input_len),
               "--output-len", *map(str, args.output_len), "--json", path]
        load = os.getloadavg()[0]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            out = json.load(f)["folio"]
    out["load_before"] = load
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, len(os.sched_getaffinity(0))])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 512])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 256])
    args = p.parse_args(argv)
    print("command: python perf/thread_scaling.py " + " ".join(sys.argv[1:] if argv is None else argv))
    lo, hi = args.threads[0], args.threads[-1]
    ratios = []
    for rnd in range(args.rounds):
        order = args.threads if rnd % 2 == 0 else args.threads[::-1]
        got = {t: run_once(t, args) for t in order}
        a, b = got[lo], got[hi]
        r = b["output_tokens_per_s"] / a["output_tokens_per_s"]
        ratios.append(r)

        def split(f):
            dec = f["decode_only_forward_time_s"]
            return f["forward_time_s"] - dec, dec

        (pa, da), (pb, db) = split(a), split(b)
        print(f"round {rnd + 1} (order {order}): output tok/s {lo} thr {a['output_tokens_per_s']:.1f}, "
              f"{hi} thr {b['output_tokens_per_s']:.1f}: {r:.2f}x | forward s, steps with prompt tokens "
              f"{pa:.1f} -> {pb:.1f} ({pa / pb:.2f}x), decode-only ({a['num_decode_only_steps']} steps) "
              f"{da:.1f} -> {db:.1f} ({da / db:.2f}x) | 1-min load before: "
              + ", ".join(f"{t} thr {got[t]['load_before']:.2f}" for t in order))
    print(f"median {hi}-thread / {lo}-thread output tok/s over {args.rounds} rounds: {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
