"""``folio serve``: one engine, two doors.

    folio serve [--model M] [--address tcp://127.0.0.1:5555 | ipc://PATH] [--host 127.0.0.1] [--port 8000]
                [--api-key KEY | --api-key-file PATH] [--allowed-origins ORIGIN ...]
                [--served-model-name NAME ...] [--chat-template FILE|TEMPLATE]
                [--device cpu|cuda|auto] [--max-model-len N] [--max-num-seqs N] ...
                [--data-parallel-size N --data-parallel-backend ray [--ray-address ADDR] [--threads-per-replica T]]

With ``--data-parallel-size N`` (N > 1) this process is a router in front of N engine replicas
placed on a Ray cluster (``folio/serve_dp.py``); the rest of this text is about one engine.

Processes: this one is the scheduler (engine loop, ZeroMQ clients on ``--address``); a worker
process runs the model; an HTTP process (FastAPI + uvicorn, ``folio/api``) serves the
OpenAI-compatible API, Prometheus ``/metrics`` and a chat page on ``http://HOST:PORT``, talking to
this process through folio's ``AsyncClient`` like any other client.

It prints progress while the model loads and warms up (a few requests of two tokens, so that the
first client does not pay for compiling the kernels), then one line, ``folio serve: ready on
ADDRESS and http://HOST:PORT ...``. Loopback only unless ``--allow-remote`` (the ZeroMQ door has no
authentication; ``--api-key`` guards the HTTP one).

SIGINT / SIGTERM / SIGHUP, to this process or to its whole process group, at any time: in-flight requests
get a ``shutdown`` error, the HTTP process and the worker stop, temporary socket folders are
removed, and the process exits 0. The worker and the HTTP process also die with this process
(``PR_SET_PDEATHSIG``). If the worker dies, this process fails every in-flight request and exits
with code 3 (see ``ipc/scheduler_process.py``); if the HTTP process dies, it exits with code 4.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .serve_http import http_process_flags, serve_with_http_process
from .runtime.common.config import ACTIVATION_QUANTIZATIONS, DEFAULT_MAX_STEP_MS, DEFAULT_MODEL, KV_CACHE_DTYPES, \
    EngineConfig

WORKER_RUNNER = "folio.runtime.worker.model_runner:ModelRunner"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags named as vLLM names them (shared by serve, repl --model and bench)."""
    d = EngineConfig()
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name, Hugging Face Llama folder, or .gguf file")
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda", "auto"],
                   help="where the model runs (auto: cuda when a GPU is usable)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (decode tokens + prefill chunks)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="longest prompt + output in tokens (None: the model's max_position_embeddings, "
                        "which is also the upper limit)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of GPU memory folio may use (GPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="automatic prefix caching")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=d.enable_chunked_prefill, help="split long prefills over several steps")
    p.add_argument("--max-step-ms", type=float, default=DEFAULT_MAX_STEP_MS,
                   help="bound, in ms, on a step that decodes running streams (their inter-token latency): a long "
                        "prompt's prefill chunk is sized from the measured prefill rate to fit it (0: chunks by "
                        "--max-num-batched-tokens only)")
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory,
                   help="KV cache bytes on CPU (None: a quarter of available memory, capped by what "
                        "max_num_seqs x max_model_len can use)")
    p.add_argument("--num-kv-blocks-override", dest="num_kv_blocks_override", type=int,
                   default=d.num_kv_blocks_override,
                   help="KV cache size in blocks on any device, overriding the sizing (None: sized from memory)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="overlap scheduling: prepare step N+1 while the worker runs step N")
    p.add_argument("--load-format", default=d.load_format, choices=["auto", "dummy"],
                   help="auto: weights from the files; dummy: random weights of the model's shapes")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                   help="weights dtype (auto: on CPU the types the weights are stored in, a .gguf file's "
                        "quantized tensors served from the file; bfloat16 on GPU; float32: everything float32)")
    p.add_argument("--quantization", default=d.quantization, choices=["q8_0", "q4_k"],
                   help="quantize float weights into this GGUF type as they load (CPU; q4_k falls back to "
                        "q8_0 for rows that are not whole 256-value blocks)")
    p.add_argument("--activation-quantization", default=d.activation_quantization, choices=list(ACTIVATION_QUANTIZATIONS),
                   help="int8: products of quantized weights take activations quantized per 32 values "
                        "(integer dot products, as llama.cpp; faster, outputs differ slightly); none: float32 "
                        "activations (the dequantized weights' exact products); auto: int8 for a quantized "
                        ".gguf file or --quantization, none for the default model (its golden outputs)")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--seed", type=int, default=d.seed, help="engine seed (unseeded requests draw from it)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON keys: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 5, "prompt_lookup_min": 3, "disable_by_batch_size": 3} (None: off; '
                        'requests without penalties or structured outputs speculate)')


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype`` (vLLM's flag), also on ``folio generate``."""
    p.add_argument("--kv-cache-dtype", default=EngineConfig().kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage (auto: float32 on CPU, bfloat16 on GPU; bfloat16 on CPU halves the KV "
                        "memory: twice the blocks, keys and values rounded to bfloat16)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=a.model, device=a.device, block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                        gpu_memory_utilization=a.gpu_memory_utilization,
                        enable_prefix_caching=a.enable_prefix_caching,
                        enable_chunked_prefill=a.enable_chunked_prefill, max_step_ms=a.max_step_ms or None,
                        kv_cache_memory=a.kv_cache_memory,
                        num_kv_blocks_override=a.num_kv_blocks_override, load_format=a.load_format,
                        dtype=a.dtype, quantization=a.quantization,
                        activation_quantization=a.activation_quantization, kv_cache_dtype=a.kv_cache_dtype, seed=a.seed,
                        async_scheduling=a.async_scheduling, speculative_config=a.speculative_config)


def register(subparsers) -> None:
    from .cli import HelpFormatter
    from .ipc.messages import DEFAULT_MAX_MESSAGE_BYTES
    from .ipc.transport import DEFAULT_ADDRESS
    p = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI API) and ZeroMQ",
                              description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="ZeroMQ bind address (tcp://HOST:PORT or ipc://PATH)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP host to serve the OpenAI-compatible API on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port, printed when ready)")
    p.add_argument("--api-key", default=None,       # the key itself never appears in --help
                   help="HTTP requests to /v1, /tokenize, /detokenize and /metrics must send 'Authorization: "
                        "Bearer KEY' (default: --api-key-file, else $FOLIO_API_KEY if set, else none; a key given "
                        "here shows in ps, the other two do not)%(default).0s")
    p.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the API key from this file (its first line) instead of the command line")
    p.add_argument("--metrics-without-key", action="store_true",
                   help="with an API key, leave /metrics open (for a Prometheus scraper without the key)")
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="browser origins (scheme://host[:port]; '*': any) whose web pages may call the HTTP API "
                        "besides the server's own (CORS); a request from another origin gets 403. Also vLLM's "
                        "form, a JSON list (None: the server's own origin only)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) the HTTP API answers to; the first is used in responses "
                        "(None: the --model value)")
    p.add_argument("--chat-template", default=None,
                   help="jinja2 chat template (a file, or the template itself) instead of the model's")
    p.add_argument("--allow-remote", action="store_true", help="allow binding non-loopback addresses")
    add_engine_args(p)
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server (info and below also log each request)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest ZeroMQ client message accepted (bigger ones get an error reply)")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest HTTP request body taken; a bigger one is answered 413 at once, before it is read "
                        "(by its Content-Length, or while it streams in). Default: 64 bytes per token of "
                        "max_model_len, at least 1 MiB (max_model_len 4096 -> 1 MiB, 131072 -> 8 MiB): a "
                        "full-length prompt of long, JSON-escaped tokens with the request's other fields. 0: no limit")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds of worker silence that count as worker death")
    p.add_argument("--exit-grace", type=float, default=2.0,
                   help="after the worker died: seconds to keep answering (unhealthy, errors) before exiting 3")
    p.add_argument("--worker-runner", default=WORKER_RUNNER, help=argparse.SUPPRESS)
    from .serve_dp import add_data_parallel_args
    add_data_parallel_args(p)
    p.set_defaults(func=run)


class _Shutdown(BaseException):
    """SIGTERM during start-up: unwinds whatever is being built (it cleans up), then exit 0."""


# SIGHUP too: a closed terminal stops the server as cleanly as Ctrl-C does
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _startup_signals() -> None:
    def on_term(signum, frame):
        raise _Shutdown()
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_term)


def _say(text: str) -> None:
    print(f"folio serve: {text}", flush=True)


def run(a: argparse.Namespace) -> int:
    _startup_signals()
    try:
        return _run(a)
    except (_Shutdown, KeyboardInterrupt):
        print("folio serve: stopped during start-up", file=sys.stderr, flush=True)
        return 0


def _run(a: argparse.Namespace) -> int:
    import time
    from .api.http_process import HttpProcess, bind_http, http_url, load_chat_template
    from .api.middleware import parse_origins
    from .ipc.scheduler_process import Server
    from .ipc.transport import private_ipc_address
    from .model.config import ModelConfig
    from .model.loader import check_quantization
    from .model.registry import resolve_model

    config = engine_config_from_args(a)
    api_key = resolve_api_key(a.api_key, a.api_key_file)
    a.allowed_origins = parse_origins(a.allowed_origins)
    t0 = time.monotonic()
    model_dir = resolve_model(config.model)                 # imports a GGUF once
    check_quantization(config.model, config.quantization, config.dtype, config.load_format)  # from the header
    max_model_len = config.resolve_max_model_len(ModelConfig.from_pretrained(model_dir).max_position_embeddings)
    load_chat_template(a.chat_template)                     # a bad template fails now, not per request
    http_sock = bind_http(a.host, a.port, a.allow_remote)   # a busy port fails before the model loads
    if a.data_parallel_size != 1:                           # N replicas on Ray behind this door
        from .serve_dp import run_data_parallel
        try:
            code = run_data_parallel(a, config, _say, STOP_SIGNALS, http_sock, max_model_len, model_dir, api_key)
        finally:
            http_sock.close()
        print("folio serve: stopped", file=sys.stderr, flush=True)
        return code
    http = server = None
    kernels = None   # the CPU kernels into Numba's cache while the worker loads the model (its own runner only)
    if a.worker_runner == WORKER_RUNNER:
        kernels = _start_kernel_compile(config)
    try:
        _say(f"loading {config.model} in the worker process (device {config.device}) ...")
        server = Server(config, a.address, allow_remote=a.allow_remote, runner=a.worker_runner,
                        max_message_bytes=a.max_message_bytes, heartbeat_timeout=a.heartbeat_timeout,
                        exit_grace=a.exit_grace)
        ex = server.executor
        info = ex.worker_info if ex is not None else {}
        loaded = time.monotonic() - t0
        if kernels is not None:
            try:
                kernels.result()
            except Exception as e:  # noqa: BLE001 - the warm-up compiles whatever is missing
                _say(f"compiling the CPU kernels ahead failed ({e}); the warm-up compiles them")
        _say(f"model loaded in {loaded:.1f} s; warming up ...")
        if a.chat_template is not None:
            server.tokenizer.set_chat_template(load_chat_template(a.chat_template))
        server.engine.warm_up()
        api_address = server.bind_extra(private_ipc_address("api"))
        num_blocks = int(server.engine.get_metrics()["num_total_blocks"])
        http = HttpProcess(http_sock, api_address, http_process_flags(a, config, model_dir, max_model_len,
                                                                     num_blocks), api_key=api_key)
        state = {"stopping": False, "http_exit": None}
        ready = (f"ready on {server.address} and {http_url(http_sock)} in {time.monotonic() - t0:.1f} s "
                 f"(model {config.model}, device {info.get('device', '?')}"
                 + (", int8 activations" if info.get("activation_quantization") == "int8" else "")
                 + f", {num_blocks} KV blocks of "
                 f"{config.block_size} tokens, worker pid {getattr(ex, 'worker_pid', '?')})")
        code = serve_with_http_process(server, http, state, STOP_SIGNALS, lambda: _say(ready))
    finally:
        for sig in STOP_SIGNALS:                          # the clean-up below is not interrupted
            signal.signal(sig, signal.SIG_IGN)
        if http is not None:
            http.stop()
        if server is not None:
            server.close()
        http_sock.close()
    print("folio serve: stopped", file=sys.stderr, flush=True)
    return code


def resolve_api_key(key: str | None, key_file: str | None) -> str | None:
    """The HTTP API key: ``--api-key``, else the first line of ``--api-key-file``, else
    ``$FOLIO_API_KEY`` (as vLLM reads ``VLLM_API_KEY``), else None.

    Raises:
        ValueError: both flags, or a key file that cannot be read or holds no key.
    """
    import os
    if key is not None and key_file is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {key_file}: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {key_file}: the file's first line is empty")
        return key
    return key if key is not None else (os.environ.get("FOLIO_API_KEY") or None)


def _start_kernel_compile(config):
    """A future of ``runtime.worker.precompile.precompile_with_progress`` (the CPU kernels of the
    model's weight layout and KV cache type into Numba's cache, in two processes, progress on the
    terminal) when the worker will run the CPU kernels on two or more threads, else None."""
    import threading
    from .runtime.worker import precompile
    if not precompile.needed(config.device):
        return None

    class Compile(threading.Thread):   # a daemon: a stop during start-up does not wait for it
        error = None

        def run(self):
            try:
                variant = precompile.weights_variant(config.model, config.dtype, config.quantization,
                                                     config.load_format, config.activation_quantization)
                precompile.precompile_with_progress(_say, variant=variant, kv_cache_dtype=config.kv_cache_dtype)
            except BaseException as e:  # noqa: BLE001 - raised by result()
                self.error = e

        def result(self):
            self.join()
            if self.error is not None:
                raise self.error

    thread = Compile(name="folio-kernel-compile", daemon=True)
    thread.start()
    return thread


def spawn_server(args: list[str], address: str | None = None, startup_timeout: float = 600.0,
                 env: dict | None = None, start_new_session: bool = False, on_line=None):
    """Start ``folio serve`` as a child process and wait for its ready line.

    Args:
        args: extra ``folio serve`` arguments (model, engine flags). Without ``--port`` the HTTP
            API takes any free port (``--port 0``), so private servers never collide.
        address: ZeroMQ bind address; default a fresh private ``ipc://`` path.
        start_new_session: run it in its own session / process group (as a terminal job would be).
        on_line: called with each line the server prints before it is ready (progress).
    Returns:
        ``(Popen, address)``; the child's stdout is a pipe (its ready line already read) and
        ``Popen.http_url`` is the HTTP API's base URL (``http://HOST:PORT``).
    Raises:
        RuntimeError: the server exited or printed no ready line within ``startup_timeout`` s.
    """
    import os
    import re
    import selectors
    import subprocess
    import time
    from .ipc.transport import cleanup_ipc_address, private_ipc_address
    address = address or private_ipc_address("serve")
    port = [] if "--port" in args else ["--port", "0"]
    proc = subprocess.Popen([sys.executable, "-m", "folio", "serve", "--address", address, *port, *args],
                            stdout=subprocess.PIPE, text=True, env=env or os.environ.copy(),
                            start_new_session=start_new_session)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + startup_timeout
    try:
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                if "ready on" in line:
                    url = re.search(r"http://\S+", line)
                    proc.http_url = url.group(0) if url else None
                    return proc, address
                if line and on_line is not None:
                    on_line(line.rstrip("\n"))
                if not line and proc.poll() is not None:
                    break
            elif proc.poll() is not None:
                break
        raise RuntimeError(f"folio serve did not become ready (exit code {proc.poll()})")
    except BaseException:
        stop_server(proc)          # SIGTERM first: a server stopped during start-up cleans up after itself
        cleanup_ipc_address(address)
        raise
    finally:
        sel.close()


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
