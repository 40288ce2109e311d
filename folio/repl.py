"""An interactive chat loop over a ``folio serve`` server (``folio repl``).

Each turn sends the whole conversation as a ``chat`` request (the server applies the model's chat
template, and the prefix cache serves the earlier turns) and prints the answer as it streams.

Commands:
  /reset              forget the conversation
  /params k=v ...     change sampling parameters (SamplingParams names), e.g. temperature=0.7 max_tokens=200;
                      /params alone shows them
  /stats              TTFT, tokens/s and prefix-cached prompt tokens of the last turn
  /help, /quit
Ctrl-C stops the current answer (the request is aborted on the server) and keeps the REPL;
Ctrl-D (or /quit) leaves with exit code 0. Line editing and history come from ``readline``
(history in ``$FOLIO_HOME/repl_history``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import fields

from .runtime.common.sampling_params import SamplingParams

# top_p as the HTTP API's default (SamplingParams': 1.0, no nucleus cut)
DEFAULT_PARAMS = {"temperature": 0.7, "top_p": 1.0, "max_tokens": 256}
PROMPT = ">>> "


def parse_value(text: str):
    """``"0.7"`` -> 0.7, ``"12"`` -> 12, ``"true"`` -> True, ``"none"`` -> None, JSON lists, else the string."""
    low = text.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(text)
    except ValueError:
        return text


def update_params(params: dict, assignments: list[str]) -> dict:
    """Apply ``k=v`` assignments; returns the new params dict.

    Raises:
        ValueError: malformed assignment, unknown name or invalid value (from ``SamplingParams``).
    """
    new = dict(params)
    names = {f.name for f in fields(SamplingParams)}
    for a in assignments:
        key, sep, value = a.partition("=")
        if not sep or not key:
            raise ValueError(f"expected name=value, got {a!r}")
        if key not in names:
            raise ValueError(f"unknown sampling parameter {key!r}")
        new[key] = parse_value(value)
    SamplingParams.from_dict(new)
    return new


class Repl:
    """The loop; ``client`` is a ``folio.Client`` (or anything with ``chat(..., stream=True)``)."""

    def __init__(self, client, params: dict | None = None, out=None, history_file: str | None = None):
        self.client = client
        self.params = dict(DEFAULT_PARAMS if params is None else params)
        self.out = out or sys.stdout
        self.messages: list[dict] = []
        self.last: dict | None = None
        self.history_file = history_file

    def _print(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def _setup_readline(self) -> None:
        try:
            import readline
        except ImportError:
            return
        if self.history_file:
            try:
                readline.read_history_file(self.history_file)
            except OSError:
                pass
            readline.set_history_length(1000)

    def _save_history(self) -> None:
        if not self.history_file:
            return
        try:
            import readline
            os.makedirs(os.path.dirname(self.history_file), exist_ok=True)
            readline.write_history_file(self.history_file)
        except (ImportError, OSError):
            pass

    def run(self) -> int:
        # Ctrl-C stops a streaming answer (KeyboardInterrupt), even when this process was started
        # with SIGINT ignored (an ignored signal stays ignored across exec, and Python then keeps
        # it so: a REPL spawned by a parent that ignores SIGINT never saw Ctrl-C)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self._setup_readline()
        self._print("folio repl: chat with the model; /help for commands, Ctrl-D to leave.")
        try:
            while True:
                try:
                    line = input(PROMPT)
                except KeyboardInterrupt:
                    self._print("^C")
                    continue
                except EOFError:
                    self._print()
                    return 0
                line = line.strip()
                if not line:
                    continue
                if line.startswith("/"):
                    if self.command(line) == "quit":
                        return 0
                    continue
                self.turn(line)
        finally:
            self._save_history()

    def command(self, line: str):
        cmd, *args = line.split()
        if cmd in ("/quit", "/exit"):
            return "quit"
        if cmd == "/reset":
            self.messages.clear()
            self._print("(conversation cleared)")
        elif cmd == "/params":
            if args:
                try:
                    self.params = update_params(self.params, args)
                except ValueError as e:
                    self._print(f"error: {e}")
                    return None
            self._print("params: " + " ".join(f"{k}={v}" for k, v in sorted(self.params.items())))
        elif cmd == "/stats":
            if self.last is None:
                self._print("no turn yet")
            else:
                s = self.last
                self._print(f"TTFT {s['ttft_ms']:.1f} ms, {s['tokens']} tokens, {s['tokens_per_s']:.1f} tokens/s, "
                            f"{s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached"
                            + (" (interrupted)" if s["interrupted"] else ""))
        elif cmd == "/help":
            self._print(__doc__.split("Commands:")[1].split("Ctrl-C")[0].rstrip())
        else:
            self._print(f"unknown command {cmd}; /help lists them")
        return None

    def turn(self, text: str) -> None:
        """One user message -> one streamed answer (Ctrl-C stops it; the turn is then dropped)."""
        from .ipc.client import ServerError
        self.messages.append({"role": "user", "content": text})
        t0 = time.monotonic()
        first = last = None
        tokens, answer, cached, prompt_tokens = 0, [], 0, 0
        stream = self.client.chat(list(self.messages), dict(self.params), stream=True)
        interrupted = False
        try:
            for d in stream:
                if d.token_ids:
                    first = first or d.time
                    last = d.time
                    tokens += len(d.token_ids)
                cached, prompt_tokens = d.num_cached_tokens, d.num_prompt_tokens
                answer.append(d.text)
                self._print(d.text, end="")
        except KeyboardInterrupt:
            interrupted = True
            stream.close()                  # sends abort
            self._print("\n[interrupted]")
        except ServerError as e:
            self._print(f"\nerror from server: {e.message}")
            self.messages.pop()
            return
        else:
            self._print()
        if interrupted:
            self.messages.pop()
        else:
            self.messages.append({"role": "assistant", "content": "".join(answer)})
        decode_s = (last - first) if first is not None and last is not None else 0.0
        self.last = {"ttft_ms": 1000 * ((first or time.monotonic()) - t0), "tokens": tokens,
                     "tokens_per_s": (tokens - 1) / decode_s if decode_s > 0 else 0.0,
                     "cached_tokens": cached, "prompt_tokens": prompt_tokens, "interrupted": interrupted}
