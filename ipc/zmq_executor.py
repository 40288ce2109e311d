"""``ZmqExecutor``: the scheduler side of the worker process (``runtime.common.executor.Executor`` over ZeroMQ).

``LLMEngine(config, executor=ZmqExecutor(config))`` runs exactly as with the in-process
``ModelRunner``: ``submit(plan)`` sends one ``step`` message and returns, ``get_result()`` reads
the oldest step's ``step_result``; the worker runs the plans in the order sent, so with overlap
scheduling the next plan waits in the worker's socket while the current step runs.

Liveness: while waiting, the executor polls every ``poll_interval`` seconds and checks
(a) that the worker process has not exited (``Popen.poll``), and (b) that a heartbeat arrived in
the last ``heartbeat_timeout`` seconds (the worker sends them from a thread of its own, so a worker
busy in a long forward pass still beats; a stopped or wedged one does not). Either failure raises
``WorkerDiedError`` (after killing a silent worker), within about ``heartbeat_timeout`` seconds
at worst; it never hangs. ``step_timeout`` (default: none) bounds one step as well.

A serving loop that must not block (``ipc/scheduler_process.py``) polls ``result_socket`` together with its
client socket, reads a result with ``get_result()`` once ``result_ready()``, and calls
``check_health()`` between polls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque

import zmq

from . import messages as M
from .transport import cleanup_ipc_address, make_socket, private_ipc_address, recv_frames, send_frames


class WorkerDiedError(RuntimeError):
    """The worker process exited, stopped answering, or failed to start."""


def _when(what: str) -> str:
    """When a worker died, for its message: "idle", "start-up", or "step N" (a step it was running)."""
    if what in ("idle", "start-up"):
        return "while idle" if what == "idle" else "during start-up"
    return f"while {what} was running"


class ZmqExecutor:
    """Spawn a worker process and drive it one StepPlan at a time.

    Args:
        config: the ``EngineConfig`` (sent to the worker, which builds its ``ModelRunner`` from it).
        runner: ``module:callable`` the worker builds its runner with (tests and benchmarks pass a
            fake or a tiny model here).
        startup_timeout: seconds to wait for ``ready`` (model loading, KV cache allocation).
        heartbeat_timeout: seconds of silence after which the worker is declared dead.
        step_timeout: seconds one step may take (``None`` = unbounded while heartbeats arrive).
    Raises:
        WorkerDiedError: the worker could not start (its message is included).
    """

    def __init__(self, config, runner: str = "folio.runtime.worker.model_runner:ModelRunner",
                 startup_timeout: float = 600.0, heartbeat_timeout: float = 10.0,
                 step_timeout: float | None = None, poll_interval: float = 0.05,
                 max_message_bytes: int = M.DEFAULT_MAX_MESSAGE_BYTES, env: dict | None = None):
        self.config = config
        self.heartbeat_timeout = heartbeat_timeout
        self.step_timeout = step_timeout
        self.poll_interval = poll_interval
        self.max_message_bytes = max_message_bytes
        self.dead_reason: str | None = None
        self.ipc_time = 0.0              # seconds, summed over steps: see get_result()
        self._submitted: deque[tuple[int, float]] = deque()  # (step_id, time sent), oldest first
        self._last_result_time = 0.0
        self._ctx = zmq.Context.instance()
        self._addr = self._hb_addr = self._sock = self._hb = self.proc = None
        self._closed = False
        # everything from the first private folder on is undone if start-up fails or is
        # interrupted (a signal to folio serve's group while the worker is being spawned raises
        # here): the worker killed, the sockets closed, their folders removed
        try:
            self._addr = private_ipc_address("worker")
            self._hb_addr = private_ipc_address("heartbeat")
            self._sock = make_socket(self._ctx, zmq.DEALER)
            self._sock.bind(self._addr)
            self._hb = make_socket(self._ctx, zmq.PULL, hwm=8)   # stale beats are dropped, not hoarded
            self._hb.bind(self._hb_addr)
            cmd = [sys.executable, "-m", "folio.ipc.worker_process", "--address", self._addr,
                   "--heartbeat-address", self._hb_addr, "--runner", runner,
                   "--max-message-bytes", str(max_message_bytes), "--parent-pid", str(os.getpid())]
            # its own session: a terminal's Ctrl-C or a signal to folio serve's process group reaches
            # only the scheduler, which then stops the worker in order (a worker still importing would
            # print a traceback); PR_SET_PDEATHSIG still ties it to the scheduler
            self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
            self._last_beat = time.monotonic()
            send_frames(self._sock, M.encode("init", config=M.config_to_dict(config), parent_pid=os.getpid()))
            # start-up (imports, weights, JIT compiles) gets a longer silence allowance than a step
            msg_type, fields = self._wait_reply(startup_timeout, what="start-up",
                                                heartbeat_timeout=max(heartbeat_timeout, 60.0))
            if msg_type == "error":
                raise WorkerDiedError(fields["message"])
            if msg_type != "ready":
                raise WorkerDiedError(f"worker answered {msg_type} to init")
        except BaseException:
            if self.proc is not None:
                self._kill()
            self._close_sockets()
            raise
        self.num_blocks = int(fields["num_blocks"])
        self.worker_pid = int(fields["pid"])
        self.worker_info = dict(fields["info"])
        # the engine reads model_config from its executor (vocab size, max length, EOS ids)
        self.model_config = None
        if isinstance(self.worker_info.get("model_config"), dict):
            from ..model.config import ModelConfig
            self.model_config = ModelConfig.from_dict(self.worker_info["model_config"])

    # -- liveness ---------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.proc.poll() is None

    def _check_alive(self, started: float, timeout: float | None, what: str,
                     heartbeat_timeout: float | None = None) -> None:
        code = self.proc.poll()
        if code is not None:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            self.dead_reason = f"worker process died ({how}) {_when(what)}"
            raise WorkerDiedError(self.dead_reason)
        now = time.monotonic()
        if now - self._last_beat > (heartbeat_timeout or self.heartbeat_timeout):
            self.dead_reason = f"worker stopped answering (no heartbeat for {now - self._last_beat:.1f} s) " \
                               f"{_when(what)}"
            self._kill()
            raise WorkerDiedError(self.dead_reason)
        if timeout is not None and now - started > timeout:
            self.dead_reason = f"worker took longer than {timeout:.1f} s for {what}"
            self._kill()
            raise WorkerDiedError(self.dead_reason)

    def _drain_heartbeats(self) -> None:
        while True:
            try:
                self._hb.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_beat = time.monotonic()

    def _wait_reply(self, timeout: float | None, what: str,
                    heartbeat_timeout: float | None = None) -> tuple[str, dict]:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._hb, zmq.POLLIN)
        started = time.monotonic()
        self._last_beat = max(self._last_beat, started - self.heartbeat_timeout / 2)
        while True:
            ready = dict(poller.poll(int(self.poll_interval * 1000)))
            if self._hb in ready:
                self._drain_heartbeats()
            if self._sock in ready:
                return M.decode(recv_frames(self._sock), self.max_message_bytes)
            self._check_alive(started, timeout, what, heartbeat_timeout)

    # -- Executor protocol --------------------------------------------------------------------------
    def check_health(self) -> None:
        """Between steps (the server calls it while idle): raise ``WorkerDiedError`` if the worker
        exited or its heartbeat stopped, so a death is reported before the next request needs it."""
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        self._drain_heartbeats()
        # steps handed over and not answered yet: the worker was running the oldest one
        self._check_alive(time.monotonic(), None, f"step {self._submitted[0][0]}" if self._submitted else "idle")

    def _send_plan(self, frames, what: str) -> None:
        # a DEALER with no connected worker blocks on send: wait for writability while checking
        # that the worker is alive, instead of blocking forever on a dead one
        started = time.monotonic()
        while True:
            try:
                send_frames(self._sock, frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                self._drain_heartbeats()
                self._check_alive(started, self.step_timeout, what)
                self._sock.poll(50, zmq.POLLOUT)

    @property
    def result_socket(self) -> zmq.Socket:
        """The socket step results arrive on (for a caller's own poller; read them with
        ``get_result``, never from the socket directly)."""
        return self._sock

    def submit(self, plan) -> None:
        """Send one plan to the worker and return. Raises ``WorkerDiedError`` if the worker is gone."""
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        self._send_plan(M.encode_plan(plan), f"step {plan.step_id}")
        self._submitted.append((int(plan.step_id), time.perf_counter()))

    def result_ready(self) -> bool:
        """Whether the oldest submitted step's answer has arrived (``get_result`` will not wait)."""
        return bool(self._submitted) and bool(self._sock.poll(0, zmq.POLLIN))

    def get_result(self):
        """The result of the oldest submitted step, waiting for it while the worker is alive.

        ``ipc_time`` grows by this step's wall time as the scheduler saw it, from when the worker
        could start it (sent, and the previous result back) to its result arriving, minus the
        worker's forward + sampling time: message encoding, the hop both ways, decoding.
        Raises:
            WorkerDiedError: the worker exited or went silent (``heartbeat_timeout``).
            RuntimeError: nothing was submitted, the worker rejected the message, or it answered
                another step.
        """
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        if not self._submitted:
            raise RuntimeError("get_result() with no step submitted")
        step_id, sent = self._submitted.popleft()
        msg_type, fields = self._wait_reply(self.step_timeout, what=f"step {step_id}")
        if msg_type == "error":
            raise RuntimeError(f"worker rejected step {step_id}: {fields['message']}")
        if msg_type != "step_result":
            raise RuntimeError(f"worker answered {msg_type} to step")
        result = M.result_from_fields(fields)
        if result.step_id != step_id:
            raise RuntimeError(f"worker answered step {result.step_id} to step {step_id}")
        now = time.perf_counter()
        could_start = max(sent, self._last_result_time)
        self.ipc_time += max(0.0, (now - could_start) - result.forward_time - result.sample_time)
        self._last_result_time = now
        return result

    def execute(self, plan):
        """``submit`` + ``get_result`` (one step at a time)."""
        self.submit(plan)
        return self.get_result()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the worker to stop, wait up to ``timeout`` s, then kill it; idempotent."""
        if self._closed:
            return
        try:
            if self.proc.poll() is None:
                try:
                    send_frames(self._sock, M.encode("shutdown"), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self._kill()
            self._close_sockets()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def _close_sockets(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in (self._sock, self._hb):
            if sock is not None:
                sock.close(0)
        for address in (self._addr, self._hb_addr):
            if address is not None:
                cleanup_ipc_address(address)

    def __del__(self):
        try:
            if not self._closed:
                self.shutdown(timeout=1.0)
        except Exception:
            pass
