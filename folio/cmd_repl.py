"""``folio repl``: chat with a model in the terminal (see ``folio/repl.py`` for the commands).

    folio repl [--address ADDR]          talk to a running ``folio serve``
    folio repl --model M [engine flags]  start a private server for the session (stopped on exit)
"""

from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    from .cmd_serve import add_engine_args
    p = subparsers.add_parser("repl", help="interactive chat with streamed answers",
                              description=__doc__)
    p.add_argument("--address", default=None,
                   help="server address (None: tcp://127.0.0.1:5555 unless --model is given)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each server message")
    p.add_argument("--params", nargs="*", default=[], metavar="K=V",
                   help="initial sampling parameters (on top of temperature=0.7 top_p=1.0 max_tokens=256; "
                        "top_p as the HTTP API's default)")
    add_engine_args(p)
    p.set_defaults(func=run, model=None)


def run(a: argparse.Namespace) -> int:
    from .ipc.client import Client
    from .ipc.transport import DEFAULT_ADDRESS
    from .repl import DEFAULT_PARAMS, Repl, update_params
    params = update_params(DEFAULT_PARAMS, a.params)
    history = os.path.join(os.environ.get("FOLIO_HOME", os.path.expanduser("~/.cache/folio")), "repl_history")
    proc = None
    address = a.address
    if a.model is not None and address is None:
        from .cmd_serve import spawn_server, stop_server
        flags = ["--model", a.model, "--device", a.device, "--block-size", str(a.block_size),
                 "--max-num-seqs", str(a.max_num_seqs), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                 "--load-format", a.load_format, "--dtype", a.dtype, "--kv-cache-dtype", a.kv_cache_dtype,
                 "--seed", str(a.seed),
                 "--gpu-memory-utilization", str(a.gpu_memory_utilization),
                 "--enable-prefix-caching" if a.enable_prefix_caching else "--no-enable-prefix-caching",
                 "--async-scheduling" if a.async_scheduling else "--no-async-scheduling"]
        flags += ["--activation-quantization", a.activation_quantization]
        for name in ("max_model_len", "kv_cache_memory", "num_kv_blocks_override", "quantization", "speculative_config"):
            if getattr(a, name) is not None:
                flags += ["--" + name.replace("_", "-"), str(getattr(a, name))]
        print(f"starting a server for {a.model} ...", flush=True)
        proc, address = spawn_server(flags, on_line=lambda line: print("  " + line, flush=True))
    try:
        with Client(address or DEFAULT_ADDRESS, timeout=a.timeout) as client:
            return Repl(client, params, history_file=history).run()
    finally:
        if proc is not None:
            stop_server(proc)
