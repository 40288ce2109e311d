"""What both ways of serving share (one engine in ``cmd_serve.py``, data-parallel replicas in
``serve_dp.py``): the HTTP process's flags, and serving a ZeroMQ door behind that
HTTP process until a stop signal or the HTTP process's exit."""

from __future__ import annotations

import argparse
import signal
import sys

EXIT_HTTP_PROCESS_DIED = 4  # folio serve's exit code when the HTTP process died on its own


def http_process_flags(a: argparse.Namespace, config, model_dir, max_model_len: int, num_blocks: int) -> dict:
    """The HTTP process's flags for an engine (or replicas) of ``num_blocks`` KV blocks."""
    from .api.http_process import default_max_request_bytes
    return {"--model-dir": str(model_dir), "--model-root": config.model,
            "--served-model-name": a.served_model_name or default_served_model_names(config.model, model_dir),
            "--max-model-len": max_model_len, "--max-num-seqs": config.max_num_seqs,
            "--kv-capacity-tokens": num_blocks * config.block_size, "--chat-template": a.chat_template,
            "--uvicorn-log-level": a.uvicorn_log_level,
            "--max-request-bytes": a.max_request_bytes if a.max_request_bytes is not None
            else default_max_request_bytes(max_model_len),
            "--allowed-origins": a.allowed_origins, "--metrics-without-key": a.metrics_without_key}


def model_own_name(model_dir) -> str:
    """The name a model folder goes by: for a folio import folder, the known name of the GGUF file
    it was imported from (``registry.packaged_model_name``: ``smollm2-135m-instruct``) or else the
    folder's name (``$FOLIO_HOME/models/<file stem>``); for another folder, its name."""
    import json
    from pathlib import Path

    from .model.gguf_import import MARKER
    from .model.registry import FLOAT32_SUFFIX, packaged_model_name
    folder = Path(model_dir)
    try:
        source = json.loads((folder / MARKER).read_text(encoding="utf-8")).get("source")
    except (OSError, ValueError, AttributeError):
        source = None
    known = packaged_model_name(source) if source else None
    return known or folder.resolve().name.removesuffix(FLOAT32_SUFFIX)


def default_served_model_names(model: str, model_dir) -> list[str]:
    """``--served-model-name``'s default: the ``--model`` value (which names the responses, as
    vLLM's default does) and, when that is a path, also the model's own name (``model_own_name``),
    so that a model served from its folder or file answers to ``model="smollm2-135m-instruct"``."""
    from pathlib import Path
    own = model_own_name(model_dir) if Path(model).expanduser().exists() else model
    return [model] if own == model else [model, own]


def serve_with_http_process(door, http, state: dict, stop_signals, ready) -> int:
    """Serve ``door`` (a ``Server`` or the data-parallel router: ``serve_forever()`` / ``stop()``)
    until a stop signal or the HTTP process's exit; ``ready()`` runs once the signal handlers are
    in place. ``state["stopping"]`` is set by a signal; ``state["http_exit"]`` records an HTTP process
    that ended on its own. Returns the exit code (``EXIT_HTTP_PROCESS_DIED`` if the HTTP process died)."""
    def on_http_exit(code):
        if not state["stopping"]:   # not asked to stop: the HTTP process ended on its own
            state["http_exit"] = code
        door.stop()

    http.watch(on_http_exit)

    def on_signal(signum, frame):
        state["stopping"] = True
        door.stop()

    for sig in stop_signals:
        signal.signal(sig, on_signal)
    ready()
    code = door.serve_forever()
    if state["http_exit"] not in (None, 0):
        print(f"folio serve: the HTTP process died (exit code {state['http_exit']})", file=sys.stderr)
        code = code or EXIT_HTTP_PROCESS_DIED
    return code
