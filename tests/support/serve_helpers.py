"""Helpers shared by the tests that run ``folio serve`` as real processes (no fixtures here; see conftest.py)."""

import os
import time

API_KEY = "sk-folio-test"  # the --api-key of the echo_http fixture's server

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # on the worker's PYTHONPATH
# the real scheduler, engine, tokenizer and IPC; the forward pass replaced by "next id = last id + 1"
ECHO = ["--worker-runner", "support.ipc_fake_runner:EchoRunner", "--max-model-len", "4096", "--max-message-bytes", "1000000"]


def echo_env(step_s=0.0, num_blocks=512, **extra):
    """Environment for a ``folio serve`` whose worker runs ``tests/support/ipc_fake_runner.EchoRunner``."""
    return {**os.environ, "PYTHONPATH": TESTS_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "FOLIO_ECHO_STEP_S": str(step_s), "FOLIO_ECHO_NUM_BLOCKS": str(num_blocks), **extra}


def echo_chain(last_prompt_id, n):
    """What EchoRunner generates after a prompt ending in ``last_prompt_id``: ``n`` successive ids."""
    return [last_prompt_id + 1 + i for i in range(n)]


def poll_until(fn, deadline_s, what):
    """``fn()``'s first truthy value, polled every 50 ms; AssertionError after ``deadline_s`` seconds."""
    end = time.monotonic() + deadline_s
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline_s} s waiting for {what}")
        time.sleep(0.05)


def pid_gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:          # a zombie not yet reaped by its (dead) parent
        return f.read().split(")")[-1].split()[0] == "Z"


def idle_metrics(client, deadline_s=60):
    """The server's metrics once it has no request in flight, running or waiting."""
    return poll_until(lambda: (lambda m: m if m["num_requests_in_flight"] == 0 and m["num_running"] == 0
                               and m["num_waiting"] == 0 else None)(client.get_metrics()), deadline_s,
                      "an idle server")
