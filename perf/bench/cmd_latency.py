"""``folio bench latency``: single-stream prefill and decode rates, llama-server in the same run."""

from __future__ import annotations

import json

from .cmd_args import add_common, add_weight_args, positive, with_threads


def add_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "latency", help="single-stream prefill and decode tok/s (one request at a time), optionally against "
                        "llama-server",
        description="One request at a time: INPUT_LEN random prompt token ids, OUTPUT_LEN greedy tokens "
                    "(ignore_eos), NUM_ITERS timed iterations after NUM_ITERS_WARMUP; prints the median "
                    "prefill tok/s (prompt tokens / time to the first token), decode tok/s (tokens after the "
                    "first / their time), TTFT and peak RSS of each engine, and how many leading greedy "
                    "tokens the engines share. --peer llama-cpp-server runs llama.cpp's server on the same "
                    "file (--model FILE.gguf) or the model's GGUF as F32 and as shipped.")
    add_common(p)
    p.add_argument("--input-len", type=positive, default=512, help="prompt tokens")
    p.add_argument("--output-len", type=positive, default=128, help="output tokens (>= 2)")
    p.add_argument("--num-iters", type=positive, default=3, help="timed iterations")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="untimed iterations first")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt")
    p.add_argument("--peer", action="append", default=[], choices=["llama-cpp-server"],
                   help="also measure llama.cpp's server (one slot; built by perf/llama.cpp/Makefile on first "
                        "use, ~15 min)")
    p.add_argument("--no-folio", action="store_true",
                   help="run only the peers (e.g. a peer's figures on a file folio cannot serve yet)")
    add_weight_args(p)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=with_threads(run))


def run(args) -> int:
    from .latency import format_latency, run_latency
    out = run_latency(args.model, input_len=args.input_len, output_len=args.output_len, num_iters=args.num_iters,
                      num_iters_warmup=args.num_iters_warmup, seed=args.seed, peers=tuple(dict.fromkeys(args.peer)),
                      threads=args.threads, run_folio=not args.no_folio, dtype=args.dtype,
                      activation_quantization=args.activation_quantization)
    print(format_latency(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
