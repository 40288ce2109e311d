"""Per-request sampling parameters, named and validated as vLLM's ``SamplingParams``.

Source: vLLM ``vllm/sampling_params.py`` (field names, defaults and the meaning of each knob);
the penalties follow the CTRL paper (Keskar et al. 2019, repetition penalty) and the OpenAI API
(presence / frequency penalties); min-p sampling: Nguyen et al. 2024, "Turning Up the Heat".
"""

from __future__ import annotations

import json as _json
import math
from dataclasses import asdict, dataclass, fields

_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # most top logprobs a request may ask for (vLLM's default max_logprobs)
# the bounds on ``stop`` (vLLM sets none; OpenAI takes 4 strings): every string is looked for after
# each new token, so the count and the total length bound that work per token
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 16384    # all stop strings together, in characters


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
        json: a JSON schema (a dict, or its JSON text): the output is a JSON value valid against it.
        regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
        choice: a non-empty list of strings; the output is one of them.
        grammar: a context-free grammar in the EBNF/GBNF form llama.cpp uses (``root ::= ...``) or
            llguidance's Lark form.
        json_object: ``True``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        disable_any_whitespace: JSON without whitespace between its tokens (vLLM's name).
        whitespace_pattern: for ``json`` and ``json_object``, a regular expression of the
            whitespace allowed between JSON tokens (vLLM's name). ``None``: at most one space,
            or one newline and up to 20 spaces or tabs (``grammar.JSON_WHITESPACE``, llama.cpp's
            JSON grammar), so that a small model cannot pad an open object with newlines until
            ``max_tokens``; ``grammar.ANY_WHITESPACE`` allows any amount.

    How the constraint is enforced, and how it behaves under overlap scheduling, ``n > 1``,
    preemption, prefix caching, stop strings, EOS and ``max_tokens``:
    ``runtime/common/grammar.py``.

    Raises:
        ValueError: from ``__post_init__``: none or more than one kind set, or a value of the
            wrong type (named in the message).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self):
        set_kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                     if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {', '.join(set_kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs json must be a JSON schema (an object or its text), got "
                             f"{type(self.json).__name__}")
        if isinstance(self.json, (dict, str)):
            try:
                schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            except (ValueError, TypeError) as e:
                raise ValueError(f"structured_outputs json is not a JSON schema: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs json must be a JSON object (a schema)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs choice must be a non-empty list of strings")
        if self.json_object not in (None, True, False):
            raise ValueError("structured_outputs json_object must be a bool")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs disable_any_whitespace must be a bool")
        if self.whitespace_pattern is not None:
            if not isinstance(self.whitespace_pattern, str) or not self.whitespace_pattern:
                raise ValueError("structured_outputs whitespace_pattern must be a non-empty string (a regex)")
            if self.disable_any_whitespace:
                raise ValueError("structured_outputs whitespace_pattern and disable_any_whitespace cannot both be set")
            if self.json is None and not self.json_object:
                raise ValueError("structured_outputs whitespace_pattern applies to json and json_object only")
        try:
            self.canonical_json()          # (also proves a dict schema is JSON)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs json is not a JSON schema: {e}") from None

    def canonical_json(self) -> str:
        """The constraint as one JSON text (keys sorted, no spaces; a ``json`` given as text is
        parsed first), computed once: what its size is measured in and its grammar's key hashes
        (``runtime/common/grammar.py``). Raises ``TypeError`` / ``ValueError`` for a value JSON
        cannot hold."""
        text = self.__dict__.get("_canonical")
        if text is None:
            d = self.to_dict()
            if isinstance(d.get("json"), str):
                d["json"] = _json.loads(d["json"])
            text = self.__dict__["_canonical"] = _json.dumps(d, sort_keys=True, separators=(",", ":"),
                                                             ensure_ascii=False, allow_nan=False)
        return text

    @property
    def kind(self) -> str:
        """The constraint's kind: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and
                (k != "disable_any_whitespace" or v)}

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutputsParams":
        """Inverse of ``to_dict``. Raises ``ValueError`` on unknown keys or invalid values."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown structured_outputs field(s): {', '.join(map(str, unknown))}")
        return cls(**d)


@dataclass
class SamplingParams:
    """How to sample the completion of one request.

    Attributes:
        n: number of independent samples (sequences) for the prompt, >= 1.
        temperature: softmax temperature, >= 0; 0 means greedy (argmax).
        top_p: nucleus sampling, keep the smallest set of tokens whose probability mass reaches
            ``top_p``; in (0, 1], 1 = off.
        top_k: keep the ``top_k`` most likely tokens; -1 or 0 = off (as vLLM).
        min_p: drop tokens whose probability is below ``min_p`` times the top token's; in [0, 1].
        seed: seed of this request's random stream (``None``: the engine's stream).
        presence_penalty: subtracted once from the logit of every token already generated;
            in [-2, 2].
        frequency_penalty: subtracted per occurrence of a token already generated; in [-2, 2].
        repetition_penalty: > 0; tokens seen in the prompt or output get positive logits divided
            and negative logits multiplied by it (1 = off).
        max_tokens: most tokens to generate (>= 0; ``None`` = up to the model length).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens are generated
            (and stop strings are not checked before).
        stop: string(s) that end generation; the output is cut right before the match unless
            ``include_stop_str_in_output``. A single string is normalised to a one-item list. At
            most ``MAX_STOP_STRINGS`` (256) non-empty strings of ``MAX_STOP_CHARS`` (16384)
            characters in all.
        stop_token_ids: token ids that end generation (their text is not part of the output
            unless ``include_stop_str_in_output``).
        ignore_eos: keep generating after EOS.
        include_stop_str_in_output: keep the matched stop string / stop token text.
        skip_special_tokens: leave special tokens out of the detokenized text.
        logprobs: return this many top logprobs per generated token (plus the sampled token's);
            ``None`` = no logprobs, 0 = only the sampled token's.
        prompt_logprobs: return, for each prompt position after the first, the raw logprob of
            the prompt token given the tokens before it plus this many top logprobs (``None`` for
            position 0; vLLM's ``RequestOutput.prompt_logprobs``); ``None`` = off. A request that
            asks for them does not read the prefix cache for its prompt (cached positions have
            no logits; vLLM V1 does the same), and needs ``max_tokens >= 1``.
        structured_outputs: a ``StructuredOutputsParams`` (or its dict) constraining the output
            to a JSON schema, regex, choice or grammar; ``None`` = free text. Not with
            ``ignore_eos`` (EOS is where the grammar ends).

    Raises:
        ValueError: from ``__post_init__`` with a message naming the field, on any invalid value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self._validate()

    def _validate(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not is_num(getattr(self, name)) or not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be an integer >= 0 or None, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if sum(map(len, self.stop)) > MAX_STOP_CHARS:
            raise ValueError(f"stop strings take at most {MAX_STOP_CHARS} characters in all, got "
                             f"{sum(map(len, self.stop))}")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {v!r}")
        if self.structured_outputs is not None and self.ignore_eos:
            raise ValueError("structured_outputs cannot be combined with ignore_eos (the output ends where "
                             "the grammar does)")

    # --- derived views -------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """True when the token is the argmax (temperature below 1e-5, as vLLM)."""
        return self.temperature < _EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    # --- IPC -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """A plain dict of the fields (msgpack-able; ``stop`` always a list; ``structured_outputs``
        a dict of its set fields, or ``None``)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """Inverse of ``to_dict``.

        Raises:
            ValueError: unknown keys (named in the message) or invalid values.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(str, unknown))}")
        return cls(**d)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields replaced (validated again)."""
        d = self.to_dict()
        d.update(changes)
        return SamplingParams.from_dict(d)


@dataclass
class BeamSearchParams:
    """Parameters of a beam search (vLLM's ``BeamSearchParams``; the algorithm and where folio
    differs from vLLM are in ``runtime/scheduler/beam_search.py``).

    Attributes:
        beam_width: beams kept each step, in ``[1, MAX_LOGPROBS // 2]`` (each beam proposes its
            ``2 * beam_width`` most likely next tokens, as vLLM and Hugging Face do).
        max_tokens: most tokens to generate (>= 0; 0 returns one empty sequence).
        ignore_eos: EOS is an ordinary token (no beam finishes early).
        temperature: >= 0. Scores are the model's raw logprobs whatever the temperature (vLLM
            V1's default ``raw_logprobs``); with ``temperature > 0`` each beam also proposes one
            token sampled at that temperature (vLLM's sampled-token candidate).
        length_penalty: the final ranking is by ``cum_logprob / len ** length_penalty`` (len = the
            generated tokens, a final EOS not counted).
        include_stop_str_in_output: a finished sequence's ``token_ids`` end with its EOS token.

    Raises:
        ValueError: from ``__post_init__``, naming the field, on any invalid value.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {self.max_tokens!r}")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BeamSearchParams":
        """Inverse of ``to_dict``.

        Raises:
            ValueError: unknown or missing keys (named in the message), or invalid values.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown beam search parameter(s): {', '.join(map(str, unknown))}")
        missing = [n for n in ("beam_width", "max_tokens") if n not in d]
        if missing:
            raise ValueError(f"missing beam search parameter(s): {', '.join(missing)}")
        return cls(**d)

    def worker_params(self) -> SamplingParams:
        """What the worker runs for each beam: one token per step (argmax, or a draw at
        ``temperature``) with the raw logprobs of its ``2 * beam_width`` most likely tokens."""
        return SamplingParams(temperature=float(self.temperature), logprobs=2 * self.beam_width,
                              max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              include_stop_str_in_output=self.include_stop_str_in_output)
