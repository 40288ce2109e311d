"""``folio serve``: the scheduler process (this one) plus a worker process, serving clients over ZeroMQ.

    folio serve [--model M] [--address tcp://127.0.0.1:5555 | ipc://PATH] [--device cpu|cuda|auto]
                [--block-size N] [--max-num-seqs N] [--max-num-batched-tokens N] [--max-model-len N]
                [--gpu-memory-utilization F] [--[no-]enable-prefix-caching] [--kv-cache-memory BYTES] ...

It prints one line, ``folio serve: ready on ADDRESS ...``, once the worker has loaded the model and
sized the KV cache. Loopback only unless ``--allow-remote`` (there is no authentication).
SIGINT / SIGTERM: in-flight requests get a ``shutdown`` error, the worker is told to stop (and
killed after a timeout), the process exits 0. The worker also dies with this process
(``PR_SET_PDEATHSIG`` plus a parent-pid check), so no orphan survives a SIGKILL either. If the
worker dies, this process fails every in-flight request and exits with code 3 (see
``ipc/server.py``).
"""

from __future__ import annotations

import argparse
import signal
import sys

from .runtime.config import DEFAULT_MODEL, EngineConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags named as vLLM names them (shared by serve, repl --model and bench)."""
    d = EngineConfig()
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or Hugging Face folder (default {DEFAULT_MODEL})")
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda", "auto"])
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill)
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="KV cache bytes (CPU)")
    p.add_argument("--num-kv-blocks-override", "--num-gpu-blocks-override", dest="num_kv_blocks_override", type=int,
                   default=d.num_kv_blocks_override, help="KV cache size in blocks, on any device (overrides sizing)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="overlap scheduling: prepare step N+1 while the worker runs step N (default on)")
    p.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"])
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=d.seed)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=a.model, device=a.device, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                        gpu_memory_utilization=a.gpu_memory_utilization,
                        enable_prefix_caching=a.enable_prefix_caching,
                        enable_chunked_prefill=a.enable_chunked_prefill, kv_cache_memory=a.kv_cache_memory,
                        num_kv_blocks_override=a.num_kv_blocks_override, load_format=a.load_format,
                        dtype=a.dtype, seed=a.seed, async_scheduling=a.async_scheduling)


def register(subparsers) -> None:
    from .ipc.messages import DEFAULT_MAX_MESSAGE_BYTES
    from .ipc.transport import DEFAULT_ADDRESS
    p = subparsers.add_parser("serve", help="serve a model to clients over ZeroMQ (scheduler + worker processes)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=DEFAULT_ADDRESS, help=f"bind address (default {DEFAULT_ADDRESS})")
    p.add_argument("--allow-remote", action="store_true", help="allow binding a non-loopback address")
    add_engine_args(p)
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest client message accepted (bigger ones get an error reply)")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds of worker silence that count as worker death")
    p.add_argument("--exit-grace", type=float, default=2.0,
                   help="after the worker died: seconds to keep answering (unhealthy, errors) before exiting 3")
    p.add_argument("--worker-runner", default="folio.runtime.model_runner:ModelRunner", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from .ipc.server import Server
    config = engine_config_from_args(a)
    server = Server(config, a.address, allow_remote=a.allow_remote, runner=a.worker_runner,
                    max_message_bytes=a.max_message_bytes, heartbeat_timeout=a.heartbeat_timeout,
                    exit_grace=a.exit_grace)

    def on_signal(signum, frame):
        server.stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    ex = server.executor
    info = ex.worker_info if ex is not None else {}
    print(f"folio serve: ready on {server.address} (model {config.model}, device {info.get('device', '?')}, "
          f"{ex.num_blocks if ex else '?'} KV blocks of {config.block_size} tokens, worker pid "
          f"{getattr(ex, 'worker_pid', '?')})", flush=True)
    code = server.serve_forever()
    print("folio serve: stopped", file=sys.stderr, flush=True)
    return code


def spawn_server(args: list[str], address: str | None = None, startup_timeout: float = 600.0,
                 env: dict | None = None, start_new_session: bool = False):
    """Start ``folio serve`` as a child process and wait for its ready line.

    Args:
        args: extra ``folio serve`` arguments (model, engine flags).
        address: bind address; default a fresh private ``ipc://`` path.
        start_new_session: run it in its own session / process group (as a terminal job would be).
    Returns:
        ``(Popen, address)``; the child's stdout is a pipe (its ready line already read).
    Raises:
        RuntimeError: the server exited or printed no ready line within ``startup_timeout`` s.
    """
    import os
    import selectors
    import subprocess
    import time
    from .ipc.transport import private_ipc_address
    address = address or private_ipc_address("serve")
    proc = subprocess.Popen([sys.executable, "-m", "folio.cli", "serve", "--address", address, *args],
                            stdout=subprocess.PIPE, text=True, env=env or os.environ.copy(),
                            start_new_session=start_new_session)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + startup_timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if "ready on" in line:
                sel.close()
                return proc, address
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    sel.close()
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    raise RuntimeError(f"folio serve did not become ready (exit code {proc.returncode})")


def stop_server(proc, timeout: float = 30.0) -> int:
    """SIGTERM a server started by ``spawn_server`` and wait for it (SIGKILL after ``timeout`` s)."""
    import subprocess
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
