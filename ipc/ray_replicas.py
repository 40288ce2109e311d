"""Engine replicas as Ray actors: the Ray side of ``folio serve --data-parallel-backend ray``.

One Ray actor per replica (``ReplicaActor``), placed by Ray with declared resources
(``num_cpus`` = the replica's threads, ``num_gpus=1`` on ``--device cuda``). The actor's process
*is* the replica's scheduler process: it builds folio's ``Server`` (``ipc/scheduler_process.py``:
the engine, and a ``ZmqExecutor`` that spawns the replica's worker process as a child), binds the
replica's ZeroMQ client door on a free TCP port of its node, warms the engine up and runs
``serve_forever`` on a thread of its own. The door (``ipc/data_parallel.py``) talks to it
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

import os
import socket
import threading
import time
from dataclasses import asdict

import ray

from ..runtime.common.config import EngineConfig

# environment variables a replica takes from the door's process (the test worker's settings,
# folio's own switches, the import path of a test runner)
_FORWARDED_ENV_PREFIXES = ("FOLIO_",)
_FORWARDED_ENV = ("PYTHONPATH", "NUMBA_CACHE_DIR")


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
        host: the IP to bind the replica's ZeroMQ door on (``None``: this node's Ray IP).
    Raises:
        Anything ``Server`` raises (the worker failed to start): Ray reports it to the caller.
    """

    def __init__(self, index: int, config: dict, server_kwargs: dict, threads: int,
                 chat_template: str | None = None, host: str | None = None):
        from .scheduler_process import Server
        os.environ["NUMBA_NUM_THREADS"] = str(threads)     # the worker child inherits it
        host = host or ray.util.get_node_ip_address()
        address = f"tcp://{host}:{_free_port(host)}"
        self.index = index
        self._stopping = False
        self.server = Server(EngineConfig(**config), address, allow_remote=True, **server_kwargs)
        if chat_template is not None:
            self.server.tokenizer.set_chat_template(chat_template)
        self.server.engine.warm_up()
        ex = self.server.executor
        self._info = {"address": address, "node_ip": host, "pid": os.getpid(),
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

    Args:
        num_replicas: the data-parallel size.
        config: the engine's ``EngineConfig`` (every replica gets the same one).
        threads: CPU threads per replica (the actor's ``num_cpus`` and the worker's Numba threads).
        ray_address: an existing cluster's address (``ray start --head`` printed it), or ``None`` to
            start a local cluster bound to loopback (stopped by ``shutdown``).
        server_kwargs, chat_template: passed to each ``ReplicaActor``.
        max_restarts: how many times Ray restarts each replica (-1: without limit).
        num_cpus: the local cluster's CPUs (``None``: ``num_replicas * threads``); logical resources
            only, Ray does not pin cores.
    Raises:
        RuntimeError: a replica failed to start (its error is included), or the cluster lacks the
            resources within ``startup_timeout`` s.
    """

    def __init__(self, num_replicas: int, config: EngineConfig, *, threads: int = 1, ray_address: str | None = None,
                 server_kwargs: dict | None = None, chat_template: str | None = None, max_restarts: int = -1,
                 num_cpus: int | None = None, startup_timeout: float = 600.0, say=print):
        self.num_replicas = num_replicas
        self.started_cluster = False
        self.actors: list = []
        self.infos: list[dict] = []
        env = {k: v for k, v in os.environ.items()
               if k.startswith(_FORWARDED_ENV_PREFIXES) or k in _FORWARDED_ENV}
        if not ray.is_initialized():
            if ray_address is None:
                say(f"starting a local Ray cluster on 127.0.0.1 ({num_cpus or num_replicas * threads} CPUs) ...")
                ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
                         num_cpus=num_cpus or num_replicas * threads, num_gpus=None if config.device != "cpu" else 0,
                         runtime_env={"env_vars": env}, log_to_driver=True, configure_logging=False)
                self.started_cluster = True
            else:
                say(f"joining the Ray cluster at {ray_address} ...")
                ray.init(address=ray_address, runtime_env={"env_vars": env}, log_to_driver=True,
                         configure_logging=False)
        try:
            # --device cuda: a GPU per replica; auto: one where the cluster has GPUs (the worker then picks cuda)
            gpu = 1 if config.device == "cuda" or (
                config.device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1) else 0
            cls = ray.remote(ReplicaActor).options(num_cpus=threads, num_gpus=gpu, max_restarts=max_restarts,
                                                   max_task_retries=0)
            host = "127.0.0.1" if self.started_cluster else None
            kwargs = dict(server_kwargs or {})
            self.actors = [cls.remote(i, asdict(config), kwargs, threads, chat_template, host)
                           for i in range(num_replicas)]
            refs = [a.info.remote() for a in self.actors]
            try:
                self.infos = ray.get(refs, timeout=startup_timeout)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(f"the {num_replicas} replicas did not start within {startup_timeout:g} s "
                                   f"(does the Ray cluster have {threads} CPU(s){' and 1 GPU' if gpu else ''} "
                                   "free for each? `ray status` shows it)") from None
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"an engine replica failed to start: {e}") from None
        except BaseException:
            self.shutdown()
            raise

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
