"""ZmqExecutor <-> worker process, with a fake runner (no model): round trip, death, silence, orphans."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest
import zmq

from folio.ipc.zmq_executor import WorkerDiedError, ZmqExecutor
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID, NewSequence, StepPlan

from support import TESTS_DIR

ENV = {**os.environ, "PYTHONPATH": str(TESTS_DIR) + os.pathsep + os.environ.get("PYTHONPATH", "")}
RUNNER = "support.ipc_fake_runner:EchoRunner"


def _plan(step_id=1, S=3):
    T = 2 * S
    return StepPlan(step_id=step_id, input_ids=np.arange(100, 100 + T, dtype=np.int64),
                    positions=np.tile(np.arange(2, dtype=np.int64), S), slot_mapping=np.arange(T, dtype=np.int64),
                    query_start_loc=np.arange(0, T + 1, 2, dtype=np.int32), seq_lens=np.full(S, 2, np.int32),
                    block_tables=np.arange(S, dtype=np.int32)[:, None], seq_ids=np.arange(S, dtype=np.int64),
                    logits_indices=np.arange(1, T, 2, dtype=np.int64), sample_seq_ids=np.arange(S, dtype=np.int64),
                    new_seqs=[NewSequence(i, [1, 2], [], {"temperature": 0.0}, None, [2]) for i in range(S)])


def _wait_gone(pid, deadline_s=10.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # reap if it is our child
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def test_round_trip_and_clean_shutdown():
    ex = ZmqExecutor(EngineConfig(), runner=RUNNER, env={**ENV, "FOLIO_ECHO_NUM_BLOCKS": "37"})
    try:
        assert ex.num_blocks == 37 and ex.is_alive()
        for step in range(1, 4):
            plan = _plan(step)
            res = ex.execute(plan)
            assert res.step_id == step
            assert np.array_equal(res.sampled_token_ids, plan.input_ids[plan.logits_indices] + 1)
    finally:
        ex.shutdown()
    assert ex.proc.returncode == 0


def _decode_plan(step_id, S=3, inputs=None):
    """One decode token per sequence at position 2; ``inputs`` (default: placeholders)."""
    ids = np.full(S, PLACEHOLDER_TOKEN_ID, np.int64) if inputs is None else np.asarray(inputs, np.int64)
    return StepPlan(step_id=step_id, input_ids=ids, positions=np.full(S, 2, np.int64),
                    slot_mapping=np.arange(S, dtype=np.int64) + 100, query_start_loc=np.arange(S + 1, dtype=np.int32),
                    seq_lens=np.full(S, 3, np.int32), block_tables=np.arange(S, dtype=np.int32)[:, None],
                    seq_ids=np.arange(S, dtype=np.int64), logits_indices=np.arange(S, dtype=np.int64),
                    sample_seq_ids=np.arange(S, dtype=np.int64))


def test_plans_queue_up_in_order_and_placeholders_take_the_last_sample():
    # overlap scheduling: plan 2 is sent before plan 1's result is read; its inputs are
    # placeholders the worker fills with what each sequence sampled in plan 1
    ex = ZmqExecutor(EngineConfig(), runner=RUNNER,
                     env={**ENV, "FOLIO_ECHO_NUM_BLOCKS": "8", "FOLIO_ECHO_STEP_S": "0.05"})
    try:
        first = _plan(1)
        ex.submit(first)
        ex.submit(_decode_plan(2))
        ex.submit(_decode_plan(3, inputs=[7, PLACEHOLDER_TOKEN_ID, 9]))
        time.sleep(1.0)          # no result read yet: plans held back until then would wait ~1 s
        r1, r2, r3 = ex.get_result(), ex.get_result(), ex.get_result()
        assert [r.step_id for r in (r1, r2, r3)] == [1, 2, 3]
        assert np.array_equal(r2.sampled_token_ids, r1.sampled_token_ids + 1)
        assert r3.sampled_token_ids.tolist() == [8, r2.sampled_token_ids[1] + 1, 10]
        # plans 2 and 3 were waiting in the socket: the worker did not wait for them (held back, they
        # would have arrived after the 1 s sleep, 0.95 s after plan 1's result; 0.5 s leaves a loaded
        # machine's stalls room either way)
        assert r2.idle_time < 0.5 and r3.idle_time < 0.5
        with pytest.raises(RuntimeError, match="no step submitted"):
            ex.get_result()
    finally:
        ex.shutdown()


def test_start_up_failure_is_reported():
    with pytest.raises(WorkerDiedError, match="fake init failure"):
        ZmqExecutor(EngineConfig(), runner=RUNNER, env={**ENV, "FOLIO_ECHO_FAIL_INIT": "1"}, startup_timeout=60)


@pytest.mark.parametrize("where", ["spawn", "bind"])
def test_an_interrupted_start_up_leaves_no_folders(tmp_path, monkeypatch, where):
    # folio serve turns a stop signal during start-up into an exception that can arrive anywhere in
    # the constructor; seen in the CLI signal test: SIGTERM while the worker was being spawned left
    # the two private socket folders behind. Raise at the spawn, and at the second socket's bind.
    import folio.ipc.zmq_executor as executor
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    class Interrupt(BaseException):
        pass

    def boom(*a, **k):
        raise Interrupt()
    if where == "spawn":
        monkeypatch.setattr(executor.subprocess, "Popen", boom)
    else:
        real = executor.make_socket
        made = []

        def make_socket(*a, **k):
            made.append(1)
            sock = real(*a, **k)
            if len(made) == 2:
                sock.bind = boom
            return sock
        monkeypatch.setattr(executor, "make_socket", make_socket)
    with pytest.raises(Interrupt):
        ZmqExecutor(EngineConfig(), runner=RUNNER, env=ENV)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig, hb_timeout, needle", [(signal.SIGKILL, 10.0, "died"),
                                                     (signal.SIGSTOP, 1.0, "stopped answering")])
def test_worker_death_or_silence_raises_quickly(sig, hb_timeout, needle):
    ex = ZmqExecutor(EngineConfig(), runner=RUNNER, env={**ENV, "FOLIO_ECHO_STEP_S": "60"},
                     heartbeat_timeout=hb_timeout)
    t0 = time.monotonic()
    try:
        ex.submit(_plan())
        os.kill(ex.worker_pid, sig)
        with pytest.raises(WorkerDiedError, match=needle):
            ex.get_result()
        # long before the 60 s step would have ended (the heartbeat or the process's exit, not the
        # step, ended the wait); half of it leaves a loaded machine room
        assert time.monotonic() - t0 < 30.0
        with pytest.raises(WorkerDiedError):     # stays dead, no hang
            ex.execute(_plan(2))
    finally:
        ex.shutdown()
    assert ex.proc.poll() is not None


def test_worker_whose_parent_died_before_it_started_exits():
    # The race behind a hang of `folio serve` signalled at start-up: the scheduler exits while its
    # worker's interpreter is still starting, so the worker's getppid() is already init's pid when
    # it first looks, and a worker that took that as its parent waited for a plan forever. Here the
    # spawner passes its pid as ZmqExecutor does and exits at once, before the worker can start.
    tmp = tempfile.mkdtemp(prefix="folio-test-")
    addresses = [f"ipc://{tmp}/w.sock", f"ipc://{tmp}/hb.sock"]
    code = textwrap.dedent(f"""
        import os, subprocess, sys
        p = subprocess.Popen([sys.executable, "-m", "folio.ipc.worker_process", "--address", {addresses[0]!r},
                              "--heartbeat-address", {addresses[1]!r}, "--runner", {RUNNER!r},
                              "--parent-pid", str(os.getpid())], start_new_session=True)
        print(p.pid, flush=True)
        os._exit(0)
    """)
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)]   # bound as the scheduler binds them
    for sock, address in zip(socks, addresses):
        sock.bind(address)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    worker_pid = int(out.stdout.split()[0])
    try:
        assert _wait_gone(worker_pid), "a worker orphaned before it started kept running"
        # it left through its orphan check, which removes the scheduler's socket files (a worker
        # that failed for another reason, such as an unknown argument, leaves them)
        assert not any(os.path.exists(a[len("ipc://"):]) for a in addresses), os.listdir(tmp)
    finally:
        for sock in socks:
            sock.close(0)
        ctx.term()
        try:
            os.kill(worker_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)


def test_worker_dies_with_its_parent():
    code = textwrap.dedent(f"""
        import sys, time
        from folio.ipc.zmq_executor import ZmqExecutor
        from folio.runtime.common.config import EngineConfig
        ex = ZmqExecutor(EngineConfig(), runner={RUNNER!r})
        print(ex.worker_pid, ex._addr, ex._hb_addr, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        pid, *addresses = parent.stdout.readline().split()
        worker_pid = int(pid)
        parent.kill()
        parent.wait(10)
        assert _wait_gone(worker_pid), "worker outlived its parent"
        # the SIGKILLed parent could not remove its private socket folders: the orphaned worker did
        folders = [os.path.dirname(a[len("ipc://"):]) for a in addresses]
        assert all(f.startswith(tempfile.gettempdir()) for f in folders), folders
        assert not any(os.path.exists(f) for f in folders), folders
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_death_found_between_polls_names_the_step_it_was_running():
    # the scheduler's loop checks the worker's health after each poll; a worker killed mid-step
    # (a stream in progress) was reported as dying "during idle"
    ex = ZmqExecutor(EngineConfig(), runner=RUNNER, env={**ENV, "FOLIO_ECHO_STEP_S": "60"})
    try:
        ex.check_health()                         # alive, nothing submitted
        ex.submit(_plan(5))
        os.kill(ex.worker_pid, signal.SIGKILL)
        ex.proc.wait(10)
        with pytest.raises(WorkerDiedError) as e:
            ex.check_health()
        assert "while step 5 was running" in str(e.value) and "idle" not in str(e.value)
    finally:
        ex.shutdown()
