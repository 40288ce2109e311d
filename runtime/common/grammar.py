"""Structured outputs: a request's constraint -> a grammar -> a token bitmask per step.

The grammar engine is llguidance (guidance-ai/llguidance, MIT). A constraint
(``StructuredOutputsParams``: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``,
vLLM's names) becomes one llguidance grammar string (``grammar_text``); a ``LLMatcher`` over the
model's tokenizer walks it token by token and fills a bitmask of the tokens allowed next.

Where the matchers live, and why
--------------------------------
vLLM V1 keeps the matchers in the scheduler process (``StructuredOutputManager``) and ships the
step's bitmask with the step; SGLang keeps its grammar objects in the scheduler too. folio runs
overlap scheduling by default (``runtime/scheduler/engine.py``): step N+1 is planned and handed to
the worker before step N's token is known, so a scheduler-side matcher could not produce step
N+1's mask without waiting for step N (constrained sequences would have to leave the overlap).
folio therefore keeps **one matcher per sequence on the worker** (``runtime/worker/``, with the
sequence's other sampling state): the worker runs plans in order, and right after it samples a
row it advances that row's matcher with the token, so the next step's mask is ready with no round
trip and no change to the overlap. What follows from it:

* ``n > 1``: every sample is its own sequence with its own sampling state, hence its own matcher.
* Preemption by recompute, and a sequence introduced mid-generation (a fork): the plan's
  ``NewSequence`` carries the tokens the sequence has already generated; the new matcher is
  **replayed** over them (as the sequence's RNG is fast-forwarded).
* Prefix caching: the matcher sees only generated tokens, never the prompt, so a cached prompt
  changes nothing.
* Stop strings and ``stop_token_ids``: the grammar masks first, so a stop token is only sampled
  where the grammar allows it; a stop *string* is found in the detokenized text by the scheduler,
  which cuts the text there: the output then ends with an unfinished structure, as vLLM's does
  (documented; do not combine stop strings with a constraint if the structure must be whole).
* EOS is allowed only where the grammar accepts (llguidance puts EOS in the mask only then, and
  only EOS once the grammar cannot continue). ``ignore_eos`` is refused with a constraint.
* ``max_tokens``: a structure cut by the token limit ends with ``finish_reason="length"``; its text
  is a prefix of a valid output, not a valid output.
* Beam search with a constraint is refused (a 400 over HTTP): every beam would need its own matcher
  forked at each step, which the beam coordinator does not do.

Compilation off the step path
-----------------------------
``GrammarValidator`` checks a constraint before admission (``LLMEngine.add_request``, the HTTP
HTTP process): the grammar is built and its lexer compiled in a thread pool, with a time bound
(``COMPILE_TIMEOUT_S``) and resource limits (``LLParserLimits``); the result is cached by the
grammar's text. An invalid, too large or too slow grammar raises ``GrammarError`` naming the field,
before the request is queued. The caller waits for the build (at most ``COMPILE_TIMEOUT_S``; a
build that times out goes on in its pool thread until llguidance's fuel limits end it): the HTTP
HTTP process checks in its own worker threads, off the event loop; ``LLMEngine.add_request`` (offline,
and the scheduler process for the ZeroMQ door and, again, for HTTP requests) checks between steps,
which costs milliseconds for a typical schema and nothing for a cached one. The worker builds each
sequence's matcher from the same text, copying a cached matcher per grammar text (llguidance builds
the lexer lazily, so a copy is cheap); the worker's grammar tokenizer is built when its first
constrained sequence arrives (once: it walks the whole vocabulary; shared with the validator in
one process).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from collections import OrderedDict

import numpy as np

COMPILE_TIMEOUT_S = 10.0   # most seconds a constraint may take to build before admission
MAX_GRAMMAR_CHARS = 1 << 20   # the longest constraint text accepted (1 MiB)
CACHE_SIZE = 256           # grammars remembered per validator / per worker
# the whitespace between JSON tokens (llguidance's ``whitespace_pattern``): by default llama.cpp's
# JSON grammar's ``ws ::= | " " | "\n" [ \t]{0,20}`` (grammars/json.gbnf), at most one space or
# one newline and 20 spaces or tabs, so that a model cannot pad with whitespace until max_tokens;
# ANY_WHITESPACE is llguidance's own default (any amount)
JSON_WHITESPACE = r"( |\n[ \t]{0,20})?"
ANY_WHITESPACE = r"[\x20\x0A\x0D\x09]*"


class GrammarError(ValueError):
    """A constraint that cannot be used; ``param`` names the request field (as ``InputError``)."""

    def __init__(self, message: str, param: str | None = "structured_outputs"):
        super().__init__(message)
        self.param = param


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - llguidance is a dependency
        raise GrammarError(f"structured outputs need the llguidance package: {e}") from None
    return llguidance


def grammar_text(so) -> str:
    """The llguidance grammar string of a ``StructuredOutputsParams`` (already validated: exactly
    one kind is set).

    Raises:
        GrammarError: the constraint is not convertible (bad JSON, a GBNF grammar that does not
            parse); deeper errors surface in ``GrammarValidator.check``.
    """
    llg = _llg()
    try:
        whitespace = {"whitespace_flexible": False} if so.disable_any_whitespace else \
            {"whitespace_flexible": True, "whitespace_pattern": so.whitespace_pattern or JSON_WHITESPACE}
        if so.json is not None:
            schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
            return llg.LLMatcher.grammar_from_json_schema(schema, overrides=whitespace)
        if so.json_object:
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=whitespace)
        if so.regex is not None:
            return llg.LLMatcher.grammar_from_regex(so.regex)
        if so.choice is not None:
            return llg.grammar_from("choice", json.dumps(list(so.choice)))
        if so.grammar is not None:
            return llg.grammar_from("grammar", so.grammar)
    except ValueError as e:
        raise GrammarError(f"structured_outputs: {so.kind} is not valid: {e}") from None
    raise GrammarError("structured_outputs sets no constraint")


_TOKENIZERS: dict = {}
_TOKENIZER_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer_json: str, eos_token_ids) -> "object":
    """The llguidance ``LLTokenizer`` of a ``tokenizer.json`` text with the engine's EOS ids (built
    once per process per tokenizer: a pass over the whole vocabulary, seconds for a large one)."""
    key = (hashlib.sha1(tokenizer_json.encode()).hexdigest(), tuple(int(t) for t in eos_token_ids))
    with _TOKENIZER_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            llg = _llg()
            tok = llg.LLTokenizer(tokenizer_json, eos_token=list(key[1]) or None)
            _TOKENIZERS[key] = tok
        return tok


def parser_limits():
    """Resource limits of every matcher (llguidance's defaults, stated here so they are ours)."""
    return _llg().LLParserLimits(max_grammar_size=500_000, max_lexer_states=250_000,
                                 initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                 verbose_errors=False)


def new_matcher(tokenizer, text: str):
    """A fresh ``LLMatcher`` for a grammar text. Raises ``GrammarError`` on a grammar error."""
    llg = _llg()
    m = llg.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
    if m.is_error():
        raise GrammarError(m.get_error())
    return m


class GrammarValidator:
    """Checks constraints before admission: build in a thread pool, bounded in time, cached by text.

    Args:
        tokenizer_json: the model's ``tokenizer.json`` text (``Tokenizer.hf.to_str()``).
        eos_token_ids: the engine's EOS ids.
        timeout_s: the time bound of one build.
    """

    _pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="folio-grammar")

    def __init__(self, tokenizer_json: str, eos_token_ids, timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer_json = tokenizer_json
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = float(timeout_s)
        self._cache: OrderedDict[str, str | None] = OrderedDict()  # grammar text -> error or None
        self._lock = threading.Lock()

    def _build(self, text: str) -> str | None:
        try:
            new_matcher(grammar_tokenizer(self.tokenizer_json, self.eos_token_ids), text)
        except GrammarError as e:
            return str(e)
        return None

    def check(self, so, param: str = "structured_outputs") -> str:
        """The grammar text of ``so`` (a ``StructuredOutputsParams``) once it builds.

        Raises:
            GrammarError(param=param): too long, invalid, or not built within ``timeout_s``.
        """
        size = len(so.json) if isinstance(so.json, str) else 0
        size += len(so.regex or "") + len(so.grammar or "") + sum(len(c) for c in so.choice or [])
        if size > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{param}: the constraint is too large ({size} characters, at most "
                               f"{MAX_GRAMMAR_CHARS})", param)
        try:
            text = grammar_text(so)
        except GrammarError as e:
            raise GrammarError(str(e).replace("structured_outputs", param, 1), param) from None
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                err = self._cache[text]
                if err is not None:
                    raise GrammarError(f"{param}: invalid {so.kind}: {err}", param)
                return text
        slow = GrammarError(f"{param}: the {so.kind} constraint took more than {self.timeout_s:g} s to compile",
                            param)
        t0 = time.perf_counter()
        fut = self._pool.submit(self._build, text)
        try:
            err = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise slow from None
        if time.perf_counter() - t0 > self.timeout_s:
            # built, but past the bound (this thread was descheduled while the build ran): the
            # bound is on the time taken, whoever noticed it
            raise slow
        with self._lock:
            self._cache[text] = err
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        if err is not None:
            raise GrammarError(f"{param}: invalid {so.kind}: {err}", param)
        return text


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask (bit ``t % 32`` of word ``t // 32`` = token t)."""
    return (int(vocab_size) + 31) // 32


def fill_bitmask(matcher, row: np.ndarray) -> None:
    """Write ``matcher``'s allowed next tokens into ``row`` (a C-contiguous int32 view of one
    bitmask row, as long as the grammar tokenizer's vocabulary needs; ids beyond stay 0 = masked)."""
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
