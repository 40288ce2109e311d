"""``folio bench kernels``: CPU kernel rates against the machine's copy bandwidth and sgemm rate."""

from __future__ import annotations

import json

from .cmd_args import positive


def add_parser(bench_subparsers) -> None:
    from .common import all_cores
    p = bench_subparsers.add_parser(
        "kernels", help="CPU kernel rates (matrix products, paged attention, decode) against copy bandwidth "
                        "and sgemm, measured in the same run",
        description="Measures folio's CPU kernels at each thread count: decode-sized products (GB/s of weights "
                    "against the copy bandwidth), batched products (GFLOP/s against BLAS sgemm on the same "
                    "shapes), paged attention for decode and prefill at contexts 128/512/2048, and "
                    "single-sequence decode of the model against its DRAM bound. See perf/bench/kernel_rates.py.")
    p.add_argument("--threads", type=positive, nargs="+", default=sorted({1, all_cores()}),
                   help="thread counts to measure, each in turn (default: 1 and every core this process may use)%(default).0s")
    p.add_argument("--repeat", type=positive, default=5, help="timed calls per figure (best and median printed)")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="model for the single-sequence decode figure ('' to skip)")
    p.add_argument("--contexts", type=positive, nargs="+", default=[128, 512, 2048],
                   help="context lengths (tokens) for the paged-attention figures")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=run)


def run(args) -> int:
    import numba

    if max(args.threads) > numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"--threads {max(args.threads)} exceeds NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}")
    from .kernel_rates import format_kernel_rates, run_kernel_rates
    out = run_kernel_rates(args.threads, repeat=args.repeat, model=args.model or None, contexts=tuple(args.contexts))
    print(format_kernel_rates(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
