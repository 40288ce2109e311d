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

Compiled once, where the matchers live, off every step path
-----------------------------------------------------------
A constraint is checked where the request enters (the HTTP process or ``LLMEngine.add_request``:
its kind and values by ``StructuredOutputsParams``, its size by ``check_constraint``; both
cheap, no grammar is built) and named by ``grammar_key`` (sha256 of its canonical JSON and the
EOS ids). It is compiled once, by the worker (``runtime/worker/grammar_matchers.py``), which
needs the compiled grammar for its matchers: the scheduler sends ``(key, constraint)`` with a plan
(``StepPlan.grammar_compiles``), the worker compiles it on its own bounded thread pool
(``GrammarMatchers.prepare``; the JSON schema or GBNF conversion too, which takes seconds for
large inputs) and reports ``(key, error)`` with a later result (``StepResult.grammar_results``).
Meanwhile the request waits outside the scheduler's queues (``runtime/scheduler/grammar_gate.py``,
as vLLM V1's scheduler skips a request whose grammar is not ready), so no step, of the engine
loop or of the worker, waits for a compile. A failed compile ends the request with an error (a
400 over HTTP; ``GrammarError`` from ``LLM.generate``); a key already known bad is refused at
``add_request``. Each compile is bounded by ``COMPILE_TIMEOUT_S`` seconds of its own thread's CPU
time, counted from when it starts (waiting in the pool's queue does not count, and neither do
other processes' or threads' use of the CPU), and by ``COMPILE_WALL_S`` of wall time; llguidance's
``LLParserLimits`` bound what a grammar may grow to. A grammar whose language is empty (a
``$ref`` cycle, ``root ::= root``) is refused: nothing the model could write satisfies it
(``compile_grammar``).
"""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np

COMPILE_TIMEOUT_S = 10.0   # most CPU seconds of its thread one compile may take
COMPILE_WALL_S = 12 * COMPILE_TIMEOUT_S  # most wall seconds from its start (a compile starved of CPU ends too)
MAX_GRAMMAR_CHARS = 1 << 20   # the longest constraint accepted, in characters of its canonical JSON (1 MiB)
CACHE_SIZE = 256           # compiled grammars (worker) and failed keys (both sides) remembered
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
            parse); deeper errors surface in ``compile_grammar``.
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


def compile_error_message(message: str, panic: bool = False) -> str:
    """A compile error as the client reads it: llguidance reports an internal limit it hits (a
    grammar with too many symbols) as a Rust panic with a ``<backtrace>`` (or raises pyo3's
    ``PanicException``: ``panic=True``); that becomes one sentence saying the constraint is too
    large (the caller logs the panic)."""
    if not panic and "<backtrace>" not in message and ": panic: " not in message:
        return message
    return ("the constraint is too large or too complex to compile (the grammar it makes is over the "
            "compiler's limits); make it smaller")


def check_constraint(so, param: str = "structured_outputs") -> None:
    """Refuse a constraint too large to compile (``MAX_GRAMMAR_CHARS`` characters of its canonical
    JSON, ``StructuredOutputsParams.canonical_json``), before anything is built.

    Raises:
        GrammarError(param=param): the constraint is too large.
    """
    size = len(so.canonical_json())
    if size > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{param}: the constraint is too large ({size} characters, at most "
                           f"{MAX_GRAMMAR_CHARS})", param)


def grammar_key(so, eos_token_ids) -> str:
    """The name of a constraint's compiled grammar: sha256 (hex) of its canonical JSON and the EOS
    ids its matchers end with (the same constraint with other EOS ids is another grammar)."""
    eos = ",".join(str(int(t)) for t in eos_token_ids)
    return hashlib.sha256(f"{eos}|{so.canonical_json()}".encode("utf-8", "surrogatepass")).hexdigest()


def compile_grammar(tokenizer, text: str):
    """A fresh ``LLMatcher`` for a grammar text, checked to admit some output.

    A grammar whose language is empty (a rule that only refers to itself, ``root ::= root``, or a
    JSON schema ``$ref`` cycle) compiles, and its matcher then allows EOS alone while not in an
    accepting state: the output would be empty and not valid. Such a grammar is refused here, by
    its first mask (one mask of one row, what the first step computes anyway; a limit that mask
    hits, e.g. llguidance's "Too many items", is refused with llguidance's message, as the first
    step would have hit it and ended the output at once). A grammar that
    admits only infinite outputs (a required property that refers back to its own object) is not
    found this way: its first tokens are allowed; ``max_tokens`` ends it with ``"length"``.

    Raises:
        GrammarError: a grammar error (llguidance's message), or an empty language.
    """
    llg = _llg()
    m = llg.LLMatcher(tokenizer, text, log_level=0, limits=parser_limits())
    if m.is_error():
        raise GrammarError(m.get_error())
    if not m.is_accepting():
        row = np.zeros(bitmask_words(tokenizer.vocab_size), dtype=np.int32)
        fill_bitmask(m, row)
        error = m.get_error().split("\n")[0] if m.is_error() else None
        if error is not None and "NoExtension" not in error:
            raise GrammarError(error)     # a limit the first mask hit (it would hit it in the first step)
        # (llguidance's matcher is in error "NoExtensionBias" when nothing extends the empty output)
        eos = np.asarray(list(tokenizer.eos_tokens), dtype=np.int64)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        if error is not None or not len(np.setdiff1d(allowed, eos)):
            raise GrammarError("the constraint admits no output (no string satisfies it: a rule that only "
                               "refers to itself, or a $ref cycle)")
    return m


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask (bit ``t % 32`` of word ``t // 32`` = token t)."""
    return (int(vocab_size) + 31) // 32


def fill_bitmask(matcher, row: np.ndarray) -> None:
    """Write ``matcher``'s allowed next tokens into ``row`` (a C-contiguous int32 view of one
    bitmask row, as long as the grammar tokenizer's vocabulary needs; ids beyond stay 0 = masked)."""
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
