"""Engine replicas as Ray actors: the Ray side of ``folio serve --data-parallel-backend ray``.

One Ray actor per replica (``ReplicaActor``), placed by Ray with declared resources
(``num_cpus`` = the replica's threads, ``num_gpus=1`` on ``--device cuda``). The actor's process
*is* the replica's scheduler process: it builds folio's ``Server`` (``ipc/scheduler_process.py``:
the engine, and a ``ZmqExecutor`` that spawns the replica's worker process as a child), binds the
replica's ZeroMQ client door (``ReplicaDoor``: loopback on the router's machine, a chosen or free
port, CURVE admitting only the router), warms the engine up and runs ``serve_forever`` on a thread
of its own. The door (``ipc/data_parallel.py``) talks to it
over that ZeroMQ address only; Ray carries nothing of a request. Ray does the placement, the
process life cycle and the restarts:

* a replica whose process dies (kill -9; its worker follows it: the worker watches its parent) is
  restarted by Ray (``max_restarts``) on whatever node has the resources; ``ReplicaSet.wait_restart``
  waits for the new incarnation and returns its address, and the router connects to it;
* a replica whose worker dies ends its own process (exit code 3, as ``folio serve`` does), which Ray
  counts as a failure and restarts in the same way;
* ``ReplicaSet.shutdown`` stops every replica (its ``Server`` stops its worker) and kills the
  actors without restart, then stops the local Ray cluster if this process started it.

Ray is imported only here (and by the command wiring); nothing below ``ipc`` imports it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace

import ray

from ..runtime.common.config import EngineConfig
from .transport import CurveKeys

# environment variables a replica takes from the door's process (the test worker's settings,
# folio's own switches, the import path of a test runner)
_FORWARDED_ENV_PREFIXES = ("FOLIO_",)
_FORWARDED_ENV = ("PYTHONPATH", "NUMBA_CACHE_DIR")


@dataclass(frozen=True)
class ReplicaDoor:
    """Where each replica's ZeroMQ door listens, and whom it admits.

    Attributes:
        port: replica ``i`` listens on ``port + i`` (``--data-parallel-rpc-port``), 0: a free port.
        router_ip: the router's node IP: a replica on the same machine binds loopback.
        allow_remote: a replica on another machine binds its node IP (reachable from the router);
            without it such a replica refuses to start.
        curve: the cluster's keys (``transport.CurveKeys.for_replicas``): only the router's client
            key is admitted; ``None``: no authentication.
    """

    port: int = 0
    router_ip: str = "127.0.0.1"
    allow_remote: bool = False
    curve: CurveKeys | None = None

    def host(self, node_ip: str) -> str:
        """The IP a replica on ``node_ip`` binds: ``127.0.0.1`` on the router's machine, else
        ``node_ip`` with ``allow_remote``.

        Raises:
            RuntimeError: another machine's replica without ``allow_remote``.
        """
        if node_ip == self.router_ip or ipaddress.ip_address(node_ip).is_loopback:
            return "127.0.0.1"
        if not self.allow_remote:
            raise RuntimeError(f"this replica runs on {node_ip}, another machine than the router ({self.router_ip}): "
                               "its door must listen on a non-loopback address; pass --allow-remote to allow that "
                               "(the doors admit only this cluster's router: CURVE keys)")
        return node_ip


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ReplicaActor:
    """One engine replica (the scheduler process of ``folio serve``, with its worker child).

    Args:
        index: the replica's data-parallel rank.
        config: ``EngineConfig`` fields (a dict).
        server_kwargs: ``Server`` keyword arguments (runner, max_message_bytes, heartbeat_timeout,
            exit_grace).
        threads: the worker's ``NUMBA_NUM_THREADS``.
        chat_template: a template text to use instead of the model's, or ``None``.
        door: where the replica's ZeroMQ door listens and whom it admits (``ReplicaDoor``).
    Raises:
        Anything ``Server`` raises (the worker failed to start), or RuntimeError (a replica on
        another machine than the router without ``allow_remote``): Ray reports it to the caller.
    """

    def __init__(self, index: int, config: dict, server_kwargs: dict, threads: int,
                 chat_template: str | None = None, door: "ReplicaDoor | None" = None):
        from .scheduler_process import Server
        door = door or ReplicaDoor()
        os.environ["NUMBA_NUM_THREADS"] = str(threads)     # the worker child inherits it
        node_ip = ray.util.get_node_ip_address()
        host = door.host(node_ip)
        address = f"tcp://{host}:{door.port + index if door.port else _free_port(host)}"
        self.index = index
        self._stopping = False
        self.server = Server(EngineConfig(**config), address, allow_remote=door.allow_remote, curve=door.curve,
                             **server_kwargs)
        if chat_template is not None:
            self.server.tokenizer.set_chat_template(chat_template)
        self.server.engine.warm_up()
        ex = self.server.executor
        self._info = {"address": address, "node_ip": node_ip, "pid": os.getpid(),
                      "worker_pid": getattr(ex, "worker_pid", None),
                      "num_total_blocks": int(self.server.engine.get_metrics()["num_total_blocks"]),
                      "device": (getattr(ex, "worker_info", None) or {}).get("device", "?"), "threads": threads,
                      "started": time.time()}
        self._thread = threading.Thread(target=self._serve, name=f"folio-replica-{index}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        code = self.server.serve_forever()
        if not self._stopping:
            # the worker died (or the engine failed): end this process so that Ray restarts the replica
            print(f"folio replica {self.index}: exiting with code {code or 1} for a restart", flush=True)
            os._exit(code or 1)

    def info(self) -> dict:
        """Where this incarnation serves: address, node_ip, pid, worker_pid, num_total_blocks, device,
        threads, started (epoch seconds)."""
        return dict(self._info)

    def stop(self, timeout: float = 20.0) -> bool:
        """Stop serving (in-flight requests get a ``shutdown`` error) and stop the worker."""
        self._stopping = True
        self.server.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()


class ReplicaSet:
    """Starts (or joins) the Ray cluster and the replica actors; restarts are Ray's.

    A local cluster (no ``ray_address``) is Ray's single-machine cluster: every Ray process
    listens on loopback only (GCS, raylet, object manager, workers; no dashboard), which Ray does
    where its node IP is loopback. Ray resolves ``127.0.0.1`` to the machine's outward address
    unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` was in the environment when Ray was imported
    (its switch for single-machine clusters; ``serve_dp`` sets it): a local cluster whose node IP
    is not loopback is refused.

    Args:
        num_replicas: the data-parallel size.
        config: the engine's ``EngineConfig`` (every replica gets the same one).
        threads: CPU threads per replica (the actor's ``num_cpus`` and the worker's Numba threads).
        ray_address: an existing cluster's address (``ray start --head`` printed it), or ``None`` to
            start a local cluster bound to loopback (stopped by ``shutdown``).
        server_kwargs, chat_template: passed to each ``ReplicaActor``.
        door: the replicas' ``ReplicaDoor`` (its ``router_ip`` is set here, to this node's).
        max_restarts: how many times Ray restarts each replica (-1: without limit).
        num_cpus: the local cluster's CPUs (``None``: ``num_replicas * threads``); logical resources
            only, Ray does not pin cores.
        say: prints progress: the cluster, then every ``progress_interval`` s the replicas still
            starting, and each replica as it is ready.
    Raises:
        RuntimeError: a replica failed to start (its error is included), the cluster lacks the
            resources within ``startup_timeout`` s, or a local cluster is not on loopback.
    """

    def __init__(self, num_replicas: int, config: EngineConfig, *, threads: int = 1, ray_address: str | None = None,
                 server_kwargs: dict | None = None, chat_template: str | None = None, door: ReplicaDoor | None = None,
                 max_restarts: int = -1, num_cpus: int | None = None, startup_timeout: float = 600.0, say=print,
                 progress_interval: float = 10.0):
        self.num_replicas = num_replicas
        self.started_cluster = False
        self.actors: list = []
        self.infos: list[dict] = []
        self._init_ray(ray_address, config, num_cpus or num_replicas * threads, say)
        try:
            # --device cuda: a GPU per replica; auto: one where the cluster has GPUs (the worker then picks cuda)
            gpu = 1 if config.device == "cuda" or (
                config.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1) else 0
            cls = ray.remote(ReplicaActor).options(num_cpus=threads, num_gpus=gpu, max_restarts=max_restarts,
                                                   max_task_retries=0)
            door = replace(door or ReplicaDoor(), router_ip=ray.util.get_node_ip_address())
            kwargs = dict(server_kwargs or {})
            self.actors = [cls.remote(i, asdict(config), kwargs, threads, chat_template, door)
                           for i in range(num_replicas)]
            try:
                self.infos = self._wait_ready(startup_timeout, progress_interval, say)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"the {num_replicas} replicas did not start within {startup_timeout:g} s "
                                   f"(does the Ray cluster have {threads} CPU(s){' and 1 GPU' if gpu else ''} "
                                   "free for each? `ray status` shows it)") from None
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"an engine replica failed to start: {e}") from None
        except BaseException:
            self.shutdown()
            raise

    def _init_ray(self, ray_address: str | None, config: EngineConfig, num_cpus: int, say) -> None:
        """Start a local cluster on loopback, or join ``ray_address`` (nothing if Ray is initialised)."""
        if ray.is_initialized():
            return
        env = {k: v for k, v in os.environ.items()
               if k.startswith(_FORWARDED_ENV_PREFIXES) or k in _FORWARDED_ENV}
        if ray_address is not None:
            say(f"joining the Ray cluster at {ray_address} ...")
            ray.init(address=ray_address, runtime_env={"env_vars": env}, log_to_driver=True, configure_logging=False)
            return
        say(f"starting a local Ray cluster on 127.0.0.1 ({num_cpus} CPUs) ...")
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", num_cpus=num_cpus,
                 num_gpus=None if config.device != "cpu" else 0, runtime_env={"env_vars": env}, log_to_driver=True,
                 configure_logging=False)
        self.started_cluster = True
        node_ip = ray.util.get_node_ip_address()
        if not ipaddress.ip_address(node_ip).is_loopback:
            ray.shutdown()
            raise RuntimeError(f"the local Ray cluster took the node IP {node_ip}, not loopback: its processes would "
                               "listen on every interface. Set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in the environment "
                               "before Ray is imported (folio serve does), or start a cluster of your own and pass "
                               "--ray-address")

    def _wait_ready(self, timeout: float, progress_interval: float, say) -> list[dict]:
        """Every replica's ``info()``, saying each one as it is ready and, every ``progress_interval``
        s, how many are still starting. Raises ``GetTimeoutError`` after ``timeout`` s, or the
        replica's error."""
        t0 = time.monotonic()
        index = {}
        for i, a in enumerate(self.actors):
            index[a.info.remote()] = i
        infos: list = [None] * len(self.actors)
        pending = list(index)
        while pending:
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                raise ray.exceptions.GetTimeoutError()
            done, pending = ray.wait(pending, num_returns=1, timeout=min(progress_interval, left))
            for ref in done:
                i = index[ref]
                infos[i] = ray.get(ref)
                say(f"replica {i} of {len(infos)} up after {time.monotonic() - t0:.0f} s: its door {infos[i]['address']}, "
                    f"pid {infos[i]['pid']}")
            if not done:
                say(f"waiting for {len(pending)} of {len(infos)} replicas ({time.monotonic() - t0:.0f} s): each "
                    "loads the model in its worker process and warms up; a first start compiles the CPU kernels "
                    "into Numba's cache (a minute or more)")
        return infos

    def wait_restart(self, index: int, previous_pid: int | None, timeout: float = 600.0,
                     should_stop=lambda: False) -> dict | None:
        """Wait until Ray restarted replica ``index`` (a new process: pid differs from
        ``previous_pid``) and return its ``info()``; ``None`` if it did not come back (restarts
        exhausted, ``timeout``, or ``should_stop()``)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and not should_stop():
            try:
                info = ray.get(self.actors[index].info.remote(), timeout=5.0)
                if info.get("pid") != previous_pid:
                    self.infos[index] = info
                    return info
            except ray.exceptions.ActorDiedError:
                return None                                 # restarts exhausted (or killed on purpose)
            except (ray.exceptions.RayError, TimeoutError):
                pass                                        # restarting: unavailable for now
            time.sleep(0.2)
        return None

    def shutdown(self) -> None:
        """Stop every replica (and its worker), kill the actors without restart, stop a local cluster."""
        if not ray.is_initialized():
            return
        refs = []
        for a in self.actors:
            try:
                refs.append(a.stop.remote())
            except Exception:
                pass
        try:
            ray.wait(refs, num_returns=len(refs), timeout=25.0)
        except Exception:
            pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        self.actors = []
        ray.shutdown()   # stops a cluster this process started; only disconnects from a joined one
