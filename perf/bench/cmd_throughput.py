"""``folio bench throughput``: offline throughput of a random workload, peers in the same run."""

from __future__ import annotations

import json

from .cmd_args import add_common, add_weight_args, positive, with_threads


def add_parser(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "throughput", help="offline throughput (random token-id prompts, ignore_eos), optionally with peers",
        description="Offline throughput: NUM_PROMPTS requests with prompt/output lengths uniform in the given "
                    "ranges, random token ids, ignore_eos, fixed seed; prints requests/s, output and total "
                    "tokens/s, KV slots holding tokens vs allocated; --peer runs the same workload through "
                    "transformers (static batches of 16), llama-cpp-python or llama.cpp's server in the same run, "
                    "every engine on --threads threads.")
    add_common(p)
    p.add_argument("--num-prompts", type=positive, default=64, help="number of requests")
    p.add_argument("--input-len", type=positive, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] (random token ids)")
    p.add_argument("--output-len", type=positive, nargs=2, default=[16, 256], metavar=("MIN", "MAX"),
                   help="output lengths, uniform in [MIN, MAX] (ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--max-num-seqs", type=positive, default=256, help="folio: most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=positive, default=2048, help="folio: token budget of one step")
    p.add_argument("--num-blocks", type=positive, default=None,
                   help="KV blocks (default: enough for every request at once)%(default).0s")
    p.add_argument("--peer", action="append", default=[], choices=["transformers", "llama-cpp", "llama-cpp-server"],
                   help="also run the workload through this peer in the same run (repeatable): transformers "
                        "(static batches), llama-cpp (llama-cpp-python, one request at a time), llama-cpp-server "
                        "(llama.cpp's server with one slot per request: on --model FILE.gguf that file as is, else the "
                        "model's GGUF as F32 and as shipped; built by perf/llama.cpp/Makefile on first use, ~15 min)")
    p.add_argument("--no-folio", action="store_true",
                   help="run only the peers (e.g. a peer's figures on a file folio cannot serve yet)")
    p.add_argument("--tf-batch-size", type=positive, default=16, help="transformers static batch size")
    p.add_argument("--busy", type=int, default=0, metavar="N",
                   help="run N processes spinning on a core each during every engine's run (a loaded machine)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="folio's KV cache storage (auto: float32 on CPU)")
    add_weight_args(p)
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.set_defaults(func=with_threads(run))


def run(args) -> int:
    if args.input_len[0] > args.input_len[1] or args.output_len[0] > args.output_len[1]:
        raise ValueError("length ranges need MIN <= MAX")
    from .throughput import format_throughput, run_throughput
    out = run_throughput(model=args.model, num_prompts=args.num_prompts, input_len=tuple(args.input_len),
                         output_len=tuple(args.output_len), seed=args.seed, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                         peers=tuple(dict.fromkeys(args.peer)), threads=args.threads,
                         tf_batch_size=args.tf_batch_size, progress=not args.no_progress, busy=args.busy,
                         run_folio=not args.no_folio, kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                         activation_quantization=args.activation_quantization)
    print(format_throughput(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
