"""``folio serve --data-parallel-size N --data-parallel-backend ray``: N engine replicas, one door.

This process is the door: it starts (or joins, ``--ray-address``) a Ray cluster, places N
replica actors on it (``ipc/ray_replicas.py``: each one a scheduler process with its own worker
process), binds the ZeroMQ client address with the data-parallel router
(``ipc/data_parallel.py``: prefix-aware routing, fan-out of health and metrics, fault handling)
and starts the HTTP process (``folio/api``) as ``folio serve`` does, talking to the router. A
supervisor thread waits for Ray to restart a replica that died and reconnects the router to it.

On loopback: a local cluster (no ``--ray-address``) is Ray's single-machine cluster, every Ray
port on 127.0.0.1 and no dashboard. Each replica's own ZeroMQ door listens on 127.0.0.1 (on
``--data-parallel-rpc-port`` + its rank, or a free port) and admits only this door's router:
ZeroMQ CURVE with keys made for this cluster at start (``transport.CurveKeys``). A replica on
another machine of a joined cluster listens on its node IP, with ``--allow-remote`` only.

SIGINT / SIGTERM / SIGHUP: in-flight requests get a ``shutdown`` error, the HTTP process stops,
every replica stops its worker, the actors are killed without restart, and a Ray cluster this
process started is stopped; exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading

# Ray's switch for a single-machine cluster: its node IP, and so every port it listens on, is
# loopback (read once, when Ray is imported: set before the first import of ray)
_RAY_LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    """The data-parallel flags (vLLM's names where it has them)."""
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas behind the one door (each a scheduler + a worker)")
    p.add_argument("--data-parallel-backend", default="ray", choices=["ray"],
                   help="what places the replicas when --data-parallel-size > 1 (Ray actors)")
    p.add_argument("--data-parallel-rpc-port", type=int, default=0,
                   help="replica i's ZeroMQ door listens on this port + i, on 127.0.0.1 (0: free ports); "
                        "the doors admit only this server's router (CURVE keys made at start)")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (as `ray start --head` printed it, e.g. 10.0.0.1:6379); "
                        "default: start a local one on 127.0.0.1, stopped on exit")
    p.add_argument("--threads-per-replica", type=int, default=1,
                   help="CPU threads of each replica's worker (the Ray actor's num_cpus)")
    p.add_argument("--max-replica-restarts", type=int, default=-1,
                   help="how many times Ray restarts a replica that died (-1: no limit)")


def run_data_parallel(a: argparse.Namespace, config, say, stop_signals, http_sock, max_model_len: int,
                      model_dir, api_key) -> int:
    """The data-parallel ``folio serve`` (module docstring); returns the exit code."""
    import time
    from .api.http_process import HttpProcess, http_url, load_chat_template
    from .serve_http import http_process_flags, serve_with_http_process
    from .ipc.transport import CurveKeys, private_ipc_address

    if a.data_parallel_size < 1 or a.threads_per_replica < 1:
        raise ValueError("--data-parallel-size and --threads-per-replica must be >= 1")
    if not 0 <= a.data_parallel_rpc_port <= 65535 - a.data_parallel_size:
        raise ValueError(f"--data-parallel-rpc-port must leave room for {a.data_parallel_size} ports below 65536")
    t0 = time.monotonic()
    template = load_chat_template(a.chat_template)
    keys = CurveKeys.generate()
    replicas = router = http = None
    state = {"stopping": False, "http_exit": None}
    try:
        replicas = _start_replicas(a, config, template, keys, say)
        infos = replicas.infos
        blocks = min(int(i["num_total_blocks"]) for i in infos)
        dead: list = []
        wake = threading.Event()

        def on_dead(index, reason):
            dead.append((index, infos[index].get("pid")))
            wake.set()

        router = _start_router(a, config, model_dir, template, infos, max_model_len, keys, on_dead)
        threading.Thread(target=_supervise, args=(replicas, router, infos, dead, wake, state),
                         name="folio-dp-supervisor", daemon=True).start()
        api_address = router.bind_extra(private_ipc_address("api"))
        http = HttpProcess(http_sock, api_address, http_process_flags(a, config, model_dir, max_model_len, blocks),
                           api_key=api_key)
        where = ", ".join(f"{i['node_ip']} pid {i['pid']}" for i in infos)
        ready = (f"ready on {router.address} and {http_url(http_sock)} in {time.monotonic() - t0:.1f} s "
                 f"(model {config.model}, {a.data_parallel_size} replicas on Ray: {where}; "
                 f"{blocks} KV blocks of {config.block_size} tokens each)")
        return serve_with_http_process(router, http, state, stop_signals, lambda: say(ready))
    finally:
        state["stopping"] = True
        for sig in stop_signals:
            signal.signal(sig, signal.SIG_IGN)
        if http is not None:
            http.stop()
        if router is not None:
            router.close()
        if replicas is not None:
            replicas.shutdown()


def _start_replicas(a: argparse.Namespace, config, template, keys, say):
    """The ``ReplicaSet`` of the flags: a local cluster on loopback unless ``--ray-address``, the
    doors on ``--data-parallel-rpc-port`` + rank with the replicas' part of ``keys``."""
    if a.ray_address is None:
        os.environ.update(_RAY_LOOPBACK_ENV)
    try:
        from .ipc.ray_replicas import ReplicaDoor, ReplicaSet
    except ImportError as e:
        raise ValueError(f"--data-parallel-backend ray needs Ray: pip install 'folio-serve[ray]' ({e})") from None
    say(f"starting {a.data_parallel_size} replicas of {config.model} on Ray "
        f"({a.threads_per_replica} thread(s) each, device {config.device}) ...")
    door = ReplicaDoor(port=a.data_parallel_rpc_port, allow_remote=a.allow_remote, curve=keys.for_replicas())
    return ReplicaSet(a.data_parallel_size, config, threads=a.threads_per_replica, ray_address=a.ray_address,
                      server_kwargs={"runner": a.worker_runner, "max_message_bytes": a.max_message_bytes,
                                     "heartbeat_timeout": a.heartbeat_timeout, "exit_grace": a.exit_grace},
                      chat_template=template, door=door, max_restarts=a.max_replica_restarts, say=say)


def _start_router(a: argparse.Namespace, config, model_dir, template, infos: list[dict], max_model_len: int, keys,
                  on_dead):
    """The ``DataParallelRouter`` on ``--address``, connected to every replica as the CURVE client
    of ``keys``, with the model's tokenizer (and ``template``) to route text and chat prompts."""
    from .ipc.data_parallel import DataParallelRouter
    from .model.tokenizer import Tokenizer
    from .runtime.inputs.input_processor import InputProcessor

    tokenizer = Tokenizer.from_pretrained(model_dir)
    if template is not None:
        tokenizer.set_chat_template(template)
    return DataParallelRouter(a.address, [i["address"] for i in infos], InputProcessor(tokenizer, max_model_len),
                              block_size=config.block_size, max_blocks=sum(int(i["num_total_blocks"]) for i in infos),
                              allow_remote=a.allow_remote, max_message_bytes=a.max_message_bytes, on_replica_dead=on_dead,
                              heartbeat_timeout=a.heartbeat_timeout, replica_info=infos, curve=keys)


def _supervise(replicas, router, infos: list[dict], dead: list, wake: threading.Event, state: dict) -> None:
    """Until ``state["stopping"]``: for each ``(index, pid)`` that ``dead`` receives (``wake`` set),
    wait for Ray to restart that replica and reconnect the router to the new incarnation."""
    while not state["stopping"]:
        if not wake.wait(0.5):
            continue
        wake.clear()
        while dead and not state["stopping"]:
            index, pid = dead.pop(0)
            info = replicas.wait_restart(index, pid, should_stop=lambda: state["stopping"])
            if info is not None:
                infos[index] = info
                router.replica_restarted(index, info["address"], info)
            elif not state["stopping"]:
                print(f"folio serve: replica {index} was not restarted (restarts exhausted?)", flush=True)
