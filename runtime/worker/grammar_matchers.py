"""Worker side of structured outputs: compiled grammars, and one matcher per constrained sequence.

Why the matchers live here (and not in the scheduler, as vLLM V1 and SGLang keep them), and how
they behave under overlap scheduling, ``n > 1``, preemption, prefix caching and stop strings:
``runtime/common/grammar.py``. In short: the worker runs plans in order and advances
each matcher with the token it has just sampled (``advance``), so the mask of the next step
(``fill_batch_bitmask``) is ready without a round trip; a sequence (re)introduced with tokens already
generated gets a matcher replayed over them (``attach``).

Grammars are compiled here and only here, before any sequence that needs one is scheduled:
``prepare`` (a plan's ``grammar_compiles``) starts a compile on this process's own thread pool
(``GRAMMAR_THREADS`` threads at a lower CPU priority than the step's, which plain requests never
use), ``poll`` reports each compile once it ends or runs past its bound (a plan's result carries
them: ``StepResult.grammar_results``), and ``release`` (the scheduler's word that no live request
uses a grammar any more) lets it be evicted. A grammar is kept while any request may still attach
a sequence to it, so ``attach`` never compiles.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait

import numpy as np

from ..common.grammar import CACHE_SIZE, COMPILE_TIMEOUT_S, COMPILE_WALL_S, GrammarError, bitmask_words, \
    compile_error_message, compile_grammar, fill_bitmask, grammar_text, grammar_tokenizer
from ..common.sampling_params import StructuredOutputsParams

GRAMMAR_THREADS = 2     # compiles at once (each holds one core while it runs)
GRAMMAR_NICE = 10       # added to the compile threads' nice value: the step's threads win a busy CPU


def _lower_priority() -> None:
    try:  # Linux: a thread's nice value is its own (setpriority on its thread id)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GRAMMAR_NICE)
    except (AttributeError, OSError):
        pass


class _CompilePool:
    """``threads`` daemon threads running compiles in order (``submit`` returns a
    ``concurrent.futures.Future``). Daemon threads, unlike ``ThreadPoolExecutor``'s: a process
    that stops (``shutdown``, SIGTERM) does not wait for a compile that llguidance cannot
    interrupt."""

    def __init__(self, threads: int, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        self._started = False

    def submit(self, fn, *args) -> Future:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        _lower_priority()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - the future carries it
                future.set_exception(e)

    def shutdown(self) -> None:
        """Cancel the queued compiles and let the threads end after the one they run."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)


class _Compile:
    """One compile in the pool: its future, and its thread's CPU clock once it has started."""

    __slots__ = ("future", "clock", "cpu0", "wall0", "released")

    def __init__(self):
        self.future = None
        self.clock = None       # the compiling thread's CPU-time clock (time.pthread_getcpuclockid)
        self.cpu0 = self.wall0 = 0.0
        self.released = False   # released while compiling: kept as spare, not pinned, when it ends

    def cpu_s(self) -> float:
        try:
            return time.clock_gettime(self.clock) - self.cpu0
        except (OSError, TypeError):
            return 0.0


class GrammarMatchers:
    """Compiles grammars (once each) and builds matchers for sequences.

    Args:
        tokenizer_json: a zero-argument callable returning the model's ``tokenizer.json`` text
            (called once, by the first compile: building the grammar tokenizer walks the whole
            vocabulary, so engines that never constrain never pay it).
        threads: the compile pool's size.
        timeout_s / wall_s: the bound of one compile in CPU seconds of its thread / in wall seconds,
            both counted from its start.
    """

    def __init__(self, tokenizer_json, threads: int = GRAMMAR_THREADS, timeout_s: float = COMPILE_TIMEOUT_S,
                 wall_s: float = COMPILE_WALL_S):
        self._tokenizer_json = tokenizer_json
        self._json_text: str | None = None
        self.timeout_s, self.wall_s = float(timeout_s), float(wall_s)
        self._pool = _CompilePool(threads, "folio-grammar")
        self._lock = threading.Lock()
        self._pinned: dict[str, tuple] = {}                  # key -> (matcher, grammar vocab): live requests use it
        self._spare: OrderedDict[str, tuple] = OrderedDict()  # released, kept for reuse (LRU)
        self._failed: OrderedDict[str, str] = OrderedDict()   # key -> error (LRU)
        self._jobs: dict[str, _Compile] = {}
        self._report: list[dict] = []                          # answers known at prepare time

    def _tokenizer(self, eos_token_ids):
        with self._lock:
            if self._json_text is None:
                self._json_text = self._tokenizer_json()
        return grammar_tokenizer(self._json_text, eos_token_ids)

    # -- compiles ------------------------------------------------------------------------------------
    def prepare(self, key: str, structured_outputs: dict, eos_token_ids) -> None:
        """Make grammar ``key`` (a ``StructuredOutputsParams`` dict, its EOS ids) ready for
        ``attach``: already compiled (pinned or spare) or known bad, it is reported at the next
        ``poll``; otherwise its compile is queued on the pool."""
        if key in self._pinned or key in self._jobs:
            if key in self._jobs:
                self._jobs[key].released = False
            else:
                self._report.append({"key": key, "error": None})
            return
        if key in self._spare:
            self._pinned[key] = self._spare.pop(key)
            self._report.append({"key": key, "error": None})
            return
        if key in self._failed:
            self._failed.move_to_end(key)
            self._report.append({"key": key, "error": self._failed[key]})
            return
        job = self._jobs[key] = _Compile()
        job.future = self._pool.submit(self._compile, job, structured_outputs, list(eos_token_ids))

    def _compile(self, job: _Compile, structured_outputs: dict, eos_token_ids: list):
        """A pool thread's work: ``(matcher, grammar vocab)`` or the error's text."""
        clock = time.pthread_getcpuclockid(threading.get_ident())
        job.cpu0, job.wall0 = time.clock_gettime(clock), time.monotonic()
        job.clock = clock               # (last: poll reads the bounds once this is set)
        try:
            so = StructuredOutputsParams.from_dict(structured_outputs)
            tokenizer = self._tokenizer(eos_token_ids)
            try:
                return compile_grammar(tokenizer, grammar_text(so)), int(tokenizer.vocab_size)
            except GrammarError as e:
                why = compile_error_message(str(e))
                if why != str(e):
                    print(f"folio worker: the grammar compiler failed: {str(e).split('<backtrace>')[0].strip()}",
                          file=sys.stderr, flush=True)
                    return f"structured_outputs: {why}"
                return why if why.startswith("structured_outputs") else f"structured_outputs: invalid {so.kind}: {why}"
        except (GrammarError, ValueError, TypeError) as e:
            return f"structured_outputs: {e}"
        except BaseException as e:  # noqa: BLE001 - a panic of the compiler (pyo3's PanicException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            print(f"folio worker: the grammar compiler failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return f"structured_outputs: {compile_error_message(str(e), panic=True)}"

    def release(self, key: str) -> None:
        """No live request uses grammar ``key`` any more: it may be evicted (it stays as a spare,
        least recently used first out, ``CACHE_SIZE`` of them)."""
        if key in self._jobs:
            self._jobs[key].released = True
            return
        entry = self._pinned.pop(key, None)
        if entry is not None:
            self._spare[key] = entry
            while len(self._spare) > CACHE_SIZE:
                self._spare.popitem(last=False)

    def pending(self) -> bool:
        """Whether compiles are running or queued, or answers wait for ``poll``."""
        return bool(self._jobs or self._report)

    def poll(self, wait_s: float = 0.0) -> list[dict]:
        """``[{"key", "error"}]``: the compiles that ended or ran past their bound since the last
        call (``error`` ``None``: compiled, now pinned), each reported once. ``wait_s`` > 0: when
        there is nothing to report yet, wait up to that long for a compile to end."""
        if wait_s > 0 and self._jobs and not self._report and not any(j.future.done() for j in self._jobs.values()):
            wait([j.future for j in self._jobs.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        out, self._report = self._report, []
        now = time.monotonic()
        for key, job in list(self._jobs.items()):
            if job.future.done():
                del self._jobs[key]
                try:
                    value = job.future.result()
                except BaseException as e:  # noqa: BLE001 - (a bug of _compile's): this request's error, not the step's
                    value = f"structured_outputs: the constraint did not compile: {type(e).__name__}: {e}"
                if isinstance(value, str):
                    self._fail(key, value)
                    out.append({"key": key, "error": value})
                    continue
                if job.released:
                    self._spare[key] = value
                    while len(self._spare) > CACHE_SIZE:
                        self._spare.popitem(last=False)
                else:
                    self._pinned[key] = value
                out.append({"key": key, "error": None})
            elif job.clock is not None and (job.cpu_s() > self.timeout_s or now - job.wall0 > self.wall_s):
                # past its bound: refused now; the thread finishes the build (llguidance cannot be
                # interrupted; its limits bound it) and its result is dropped
                del self._jobs[key]
                why = (f"structured_outputs: the constraint took more than {self.timeout_s:g} s to compile"
                       if job.cpu_s() > self.timeout_s else
                       f"structured_outputs: the constraint did not compile within {self.wall_s:g} s")
                self._fail(key, why)
                out.append({"key": key, "error": why})
        return out

    def _fail(self, key: str, error: str) -> None:
        self._failed[key] = error
        while len(self._failed) > CACHE_SIZE:
            self._failed.popitem(last=False)

    # -- sequences -----------------------------------------------------------------------------------
    def attach(self, state, key: str) -> None:
        """Give ``state`` (a ``SamplingState``) a matcher of grammar ``key`` (prepared, compiled
        and not released: the scheduler schedules a constrained sequence only then), replayed over
        the tokens it already generated.

        Raises:
            GrammarError: ``key`` is not compiled here (a scheduler that did not wait for it), or
                the replayed tokens are not accepted (a sequence restored after a preemption
                replays its own output, always accepted).
        """
        entry = self._pinned.get(key) or self._spare.get(key)
        if entry is None:
            raise GrammarError(f"seq {state.seq_id}: grammar {key[:12]} was not compiled on this worker "
                               "(prepare it and wait for its result first)")
        base, vocab = entry
        m = base.deep_copy()
        done = state.output_token_ids.tolist()
        if done and not m.consume_tokens(done):
            raise GrammarError(f"seq {state.seq_id}: its generated tokens do not replay through its grammar: "
                               f"{m.get_error()}")
        state.matcher = m
        state.grammar_vocab = vocab

    def shutdown(self) -> None:
        """Stop compiling (a compile under way is abandoned: its thread is a daemon)."""
        self._pool.shutdown()


def fill_batch_bitmask(states, vocab_size: int) -> np.ndarray | None:
    """The step's bitmask ``[R, ceil(V / 32)]`` int32 (bit ``t % 32`` of word ``t // 32`` set =
    token ``t`` allowed), or ``None`` when no row is constrained. Unconstrained rows are all ones;
    a constrained row allows what its matcher allows (ids past the grammar tokenizer's vocabulary,
    a model's padding rows, never); a matcher that is stopped or in error allows EOS only (its
    sequence has ended; with overlap scheduling a token computed after the end is discarded)."""
    rows = [i for i, s in enumerate(states) if s.matcher is not None]
    if not rows:
        return None
    W = bitmask_words(vocab_size)
    mask = np.full((len(states), W), -1, dtype=np.int32)
    par = []  # rows whose matcher fills a whole row: computed together, on the executor's threads
    for i in rows:
        st = states[i]
        mask[i] = 0
        m = st.matcher
        if m.is_error() or m.is_stopped():
            for t in st.eos_token_ids:
                if 0 <= t < vocab_size:
                    mask[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
            continue
        if bitmask_words(st.grammar_vocab) == W:
            par.append((m, i))
        else:  # a model whose vocabulary is padded past the tokenizer's: the row's prefix
            fill_bitmask(m, mask[i, :bitmask_words(min(st.grammar_vocab, vocab_size))])
    if len(par) > 1:
        _executor().unsafe_compute_mask_ptr(par, mask.ctypes.data, W * 4, len(states))
    elif par:
        fill_bitmask(par[0][0], mask[par[0][1]])
    return mask


_EXECUTOR = None


def _executor():
    """llguidance's thread pool for batched masks (one per process, as many threads as cores)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import os

        import llguidance
        _EXECUTOR = llguidance.LLExecutor(num_threads=max(1, len(os.sched_getaffinity(0))))
    return _EXECUTOR


def advance(states, tokens) -> None:
    """Advance each constrained row's matcher with the token sampled for it (a matcher already
    stopped, its sequence over, is left alone)."""
    for st, t in zip(states, tokens):
        m = st.matcher
        if m is not None and not m.is_stopped() and not m.is_error():
            m.consume_token(int(t))
