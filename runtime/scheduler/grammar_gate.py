"""Requests that wait for their grammar: held out of the scheduler until the worker compiled it.

The scheduler side of "compiled once, where the matchers live" (``runtime/common/grammar.py``):
a constrained request is admitted to the scheduler's queues only once the worker reports its
grammar compiled, so no step waits for a compile (vLLM V1's scheduler likewise skips a request
whose grammar is not ready, ``WAITING_FOR_FSM``). The gate:

* ``admit``: a request whose grammar the worker holds runs at once; one whose key is known bad
  is refused (``GrammarError``); any other is held, and its grammar queued to send
  (``take_compiles``: the next plan's ``grammar_compiles``).
* ``on_results``: the worker's answers (``StepResult.grammar_results``): the held requests of a
  compiled grammar become runnable, those of a failed one fail with its error.
* ``finished``: a request ended (any way); when no live request uses a grammar any more, the
  worker is told to release it (``take_releases``: the next plan's ``grammar_releases``), so the
  worker keeps every grammar a sequence may still need and only those.
* ``expired``: keys the worker did not answer within ``answer_timeout_s`` (a runner that does not
  compile grammars; a lost answer) fail their requests rather than hold them forever.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from ..common.grammar import CACHE_SIZE, COMPILE_WALL_S, GrammarError


class GrammarGate:
    """The constrained requests between ``add_request`` and the scheduler's queues.

    Args:
        answer_timeout_s: the longest a compile request waits for the worker's answer (its own
            bounds are ``COMPILE_TIMEOUT_S`` CPU seconds and ``COMPILE_WALL_S`` wall seconds).
    """

    def __init__(self, answer_timeout_s: float = COMPILE_WALL_S + 10.0):
        self.answer_timeout_s = float(answer_timeout_s)
        self._live: dict[str, int] = {}                   # key -> unfinished requests using it
        self._ready: set[str] = set()                     # compiled and pinned on the worker
        self._errors: OrderedDict[str, str] = OrderedDict()  # key -> the worker's error (LRU)
        self._held: dict[str, list] = {}                  # key -> requests waiting for it
        self._key_of: dict[str, str] = {}                 # request id -> key, while it lives
        self._to_send: dict[str, dict] = {}               # key -> compile entry not sent yet
        self._sent: dict[str, float] = {}                 # key -> time.monotonic() it was sent
        self._to_release: set[str] = set()

    # -- requests -------------------------------------------------------------------------------------
    def admit(self, request, so, eos_token_ids, param: str = "structured_outputs") -> bool:
        """Take a constrained ``request`` (its ``grammar_key`` set; ``so`` its
        ``StructuredOutputsParams``). Returns whether it may run now (its grammar is on the worker);
        ``False``: it is held until ``on_results`` says so.

        Raises:
            GrammarError(param=param): the worker already refused this grammar (nothing is held).
        """
        key = request.grammar_key
        err = self._errors.get(key)
        if err is not None:
            self._errors.move_to_end(key)
            raise GrammarError(err.replace("structured_outputs", param, 1), param)
        self._live[key] = self._live.get(key, 0) + 1
        self._key_of[request.request_id] = key
        self._to_release.discard(key)
        if key in self._ready:
            return True
        self._held.setdefault(key, []).append(request)
        if key not in self._sent and key not in self._to_send:
            self._to_send[key] = {"key": key, "structured_outputs": so.to_dict(),
                                  "eos_token_ids": [int(t) for t in eos_token_ids]}
        return False

    def is_held(self, request_id: str) -> bool:
        key = self._key_of.get(request_id)
        return key is not None and any(r.request_id == request_id for r in self._held.get(key, ()))

    def drop(self, request_id: str):
        """Take a held request out (an abort); returns it, or ``None`` when it is not held."""
        key = self._key_of.get(request_id)
        for i, r in enumerate(self._held.get(key, ()) if key is not None else ()):
            if r.request_id == request_id:
                del self._held[key][i]
                if not self._held[key]:
                    del self._held[key]
                self.finished(request_id)
                return r
        return None

    def finished(self, request_id: str) -> None:
        """``request_id`` ended; a grammar no live request uses any more is released."""
        key = self._key_of.pop(request_id, None)
        if key is None:
            return
        left = self._live.get(key, 0) - 1
        if left > 0:
            self._live[key] = left
            return
        self._live.pop(key, None)
        self._to_send.pop(key, None)
        if key in self._ready:
            self._ready.discard(key)
            self._to_release.add(key)

    def has_held(self) -> bool:
        return bool(self._held)

    def num_held(self) -> int:
        return sum(len(v) for v in self._held.values())

    # -- the worker -----------------------------------------------------------------------------------
    def waiting_for_worker(self) -> bool:
        """Whether a plan should go out even with nothing to run: compiles or releases to send,
        or answers to wait for."""
        return bool(self._to_send or self._to_release or (self._sent and self._held))

    def take_compiles(self) -> list[dict]:
        out = list(self._to_send.values())
        now = time.monotonic()
        for c in out:
            self._sent[c["key"]] = now
        self._to_send.clear()
        return out

    def take_releases(self) -> list[str]:
        out = sorted(self._to_release)
        self._to_release.clear()
        return out

    def on_results(self, results) -> tuple[list, list]:
        """Apply the worker's ``[{"key", "error"}]``. Returns ``(runnable, failed)``: the held
        requests whose grammar compiled, and ``(request, error)`` of those whose grammar failed
        (already taken out of the gate: the caller ends them)."""
        runnable, failed = [], []
        for r in results:
            key, err = r["key"], r.get("error")
            self._sent.pop(key, None)
            held = self._held.pop(key, [])
            if err is not None:
                self._errors[key] = err
                while len(self._errors) > CACHE_SIZE:
                    self._errors.popitem(last=False)
                for request in held:
                    self.finished(request.request_id)
                    failed.append((request, err))
                continue
            if self._live.get(key, 0) > 0:
                self._ready.add(key)
                runnable.extend(held)
            else:                    # every request of it ended while it compiled
                self._to_release.add(key)
        return runnable, failed

    def expired(self, now: float | None = None) -> list:
        """``(request, error)`` of held requests whose grammar the worker has not answered within
        ``answer_timeout_s`` of its sending (taken out of the gate; the key is not remembered)."""
        now = time.monotonic() if now is None else now
        failed = []
        for key, sent in list(self._sent.items()):
            if now - sent > self.answer_timeout_s:
                del self._sent[key]
                err = ("structured_outputs: the worker did not compile the constraint within "
                       f"{self.answer_timeout_s:g} s")
                for request in self._held.pop(key, []):
                    self.finished(request.request_id)
                    failed.append((request, err))
        return failed
