"""What both ways of serving share (one engine in ``cmd_serve.py``, data-parallel replicas in
``serve_dp.py``): the HTTP front-end process's flags, and serving a ZeroMQ door behind that front
end until a stop signal or the front end's exit."""

from __future__ import annotations

import argparse
import signal
import sys

EXIT_FRONTEND_DIED = 4  # folio serve's exit code when the HTTP front-end process died on its own


def front_end_flags(a: argparse.Namespace, config, model_dir, max_model_len: int, num_blocks: int) -> dict:
    """The HTTP front-end process's flags for an engine (or replicas) of ``num_blocks`` KV blocks."""
    from .api.frontend import default_max_request_bytes
    return {"--model-dir": str(model_dir), "--model-root": config.model,
            "--served-model-name": a.served_model_name or [config.model], "--max-model-len": max_model_len,
            "--kv-capacity-tokens": num_blocks * config.block_size, "--chat-template": a.chat_template,
            "--uvicorn-log-level": a.uvicorn_log_level,
            "--max-request-bytes": a.max_request_bytes if a.max_request_bytes is not None
            else default_max_request_bytes(max_model_len)}


def serve_behind_front(door, front, state: dict, stop_signals, ready) -> int:
    """Serve ``door`` (a ``Server`` or the data-parallel router: ``serve_forever()`` / ``stop()``)
    until a stop signal or the HTTP front end's exit; ``ready()`` runs once the signal handlers are
    in place. ``state["stopping"]`` is set by a signal; ``state["front_exit"]`` records a front end
    that ended on its own. Returns the exit code (``EXIT_FRONTEND_DIED`` if the front end died)."""
    def on_front_exit(code):
        if not state["stopping"]:   # not asked to stop: the front end ended on its own
            state["front_exit"] = code
        door.stop()

    front.watch(on_front_exit)

    def on_signal(signum, frame):
        state["stopping"] = True
        door.stop()

    for sig in stop_signals:
        signal.signal(sig, on_signal)
    ready()
    code = door.serve_forever()
    if state["front_exit"] not in (None, 0):
        print(f"folio serve: the HTTP front end died (exit code {state['front_exit']})", file=sys.stderr)
        code = code or EXIT_FRONTEND_DIED
    return code
