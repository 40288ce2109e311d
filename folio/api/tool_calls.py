"""OpenAI tool calling over folio's structured outputs: the constraint a ``tool_choice`` needs, and
the parser that turns a completion into ``message.tool_calls``.

``tool_choice`` (OpenAI's API; vLLM's ``serving_chat.py`` behaves the same way):

* ``"none"``: the tools are not rendered and no call is parsed; the output is text.
* ``"auto"`` (the default when ``tools`` are given): the model's chat template renders the tools;
  the model writes either text or calls in the template's format, which ``ToolCallParser``
  understands in two forms:
    - Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per
      call; text before the first block is the message's content);
    - Llama 3.x JSON: the output is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
      optionally after ``<|python_tag|>``, several separated by ``;``.
  Nothing is enforced: an object that does not name one of the tools stays text.
* ``"required"``: the output is constrained (``tool_constraint``) to a JSON array of
  ``{"name": one of the functions, "parameters": that function's parameters schema}``, at least one
  item (exactly one when ``parallel_tool_calls`` is false): every call's arguments validate.
* ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's parameters
  schema; it is the call's arguments.

The response carries ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``,
``function.arguments``: the JSON text of the arguments as the model wrote it) and
``finish_reason`` ``"tool_calls"``. A stream sends the calls as OpenAI does, as the model writes
them: in ``delta.tool_calls`` items with ``index``, the first of each call (as soon as its name is
read) with its ``id``, ``type`` and ``function.name`` and empty arguments, then the arguments in
pieces whose concatenation is the whole response's ``arguments``; the text of a call never goes
to ``delta.content``.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from .protocol import APIError

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _function(i: int, t) -> tuple[str, dict]:
    """``(name, parameters schema)`` of ``tools[i]``. Raises ``APIError(400)``."""
    f = t.get("function") if isinstance(t, dict) else None
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
            or not isinstance(f.get("name"), str) or not f["name"]:
        raise APIError(400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
    params = f.get("parameters") or EMPTY_PARAMETERS
    if not isinstance(params, dict):
        raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    return f["name"], params


def _functions(tools: list[dict]) -> dict[str, dict]:
    """``name -> parameters schema`` of the request's tools. Raises ``APIError(400)``."""
    return dict(_function(i, t) for i, t in enumerate(tools))


def validate_tools(tools: list[dict]) -> None:
    """Check a request's ``tools`` whatever the ``tool_choice``: each is ``{type: function,
    function: {name, parameters}}``, no name is given twice, and each ``parameters`` is a JSON
    schema llguidance can read (its grammar validated without a tokenizer, well under a
    millisecond for a small schema; a ``required`` or named choice's constraint is compiled whole
    by the engine's worker, ``runtime/worker/grammar_matchers.py``).

    Raises:
        APIError(400, param tools): naming the tool at fault.
    """
    import llguidance

    from ..runtime.common.grammar import GrammarError, grammar_text, parser_limits
    from ..runtime.common.sampling_params import StructuredOutputsParams
    seen: dict[str, int] = {}
    for i, t in enumerate(tools):
        name, params = _function(i, t)
        if name in seen:
            raise APIError(400, f"tools[{i}]: the function name {name!r} is already used by tools[{seen[name]}]; "
                                "function names must be unique", "tools")
        seen[name] = i
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_text(StructuredOutputsParams(json=params)),
                                                          None, limits=parser_limits())
        except (GrammarError, ValueError) as e:
            error = str(e)
        if error:
            raise APIError(400, f"tools[{i}].function.parameters ({name}) is not a valid JSON schema: "
                                f"{error.split('<backtrace>', 1)[0].strip()}", "tools")


def resolve_tool_choice(tools: list[dict] | None, tool_choice: Any) -> tuple[str, str | None]:
    """``(mode, function name)``: mode ``none``, ``auto``, ``required`` or ``named``.

    Raises:
        APIError(400, param tool_choice): an unknown choice, a named function not in ``tools``, or
            a choice other than none without tools.
    """
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}",
                           "tool_choice")
        if tool_choice != "none" and not tools:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    f = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be {type: function, function: {name}}", "tool_choice")
    if name not in _functions(tools or []):
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return "named", name


def tool_constraint(tools: list[dict], mode: str, name: str | None, parallel: bool) -> dict | None:
    """The ``structured_outputs`` dict that enforces ``required`` / a named function, or ``None``."""
    funcs = _functions(tools)
    if mode == "named":
        return {"json": funcs[name]}
    if mode == "required":
        item = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for n, p in funcs.items()]}
        schema = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return {"json": schema}
    return None


# ---------------------------------------------------------------------------------------------
# the incremental parser: one per choice, fed the output's text as it arrives
# ---------------------------------------------------------------------------------------------

TOOL_CALL_TAG, PYTHON_TAG = "<tool_call>", "<|python_tag|>"
_WS = " \t\r\n"
_SCALAR = frozenset("-+.0123456789eEtrufalsn")     # the characters of JSON numbers, true, false, null
_VALUE_START = frozenset('{["-0123456789tfn')


@dataclass(frozen=True)
class ToolCallEvent:
    """What a ``ToolCallParser`` found in the text fed to it, in output order.

    ``kind``:
      * ``"content"``: ``text`` is more of the message's content;
      * ``"call"``: call number ``index`` (0, 1, ... within the choice) begins: its ``call_id`` and
        function name (``text``), known before any of its arguments;
      * ``"arguments"``: ``text`` is the next piece of call ``index``'s ``function.arguments``.
    """

    kind: str
    text: str
    index: int = -1
    call_id: str | None = None


class _CallObject:
    """Scan state of one ``{"name": ..., "arguments"|"parameters": ...}`` object (keys in any order,
    other keys skipped)."""

    def __init__(self):
        self.state = "key_or_end"   # key_or_end | key | colon | value_start | value | after_value
        self.key_start = 0
        self.key = ""
        self.kind = "other"         # of the value being scanned: name | arguments | other
        self.shape = ""             # of that value: string | compound | scalar
        self.value_start = 0
        self.depth = 0
        self.in_string = self.escaped = False
        self.sent_to = 0            # arguments: the buffer index up to which they were handed out
        self.name: str | None = None
        self.has_arguments = False
        self.index: int | None = None   # the call's number once its name is known
        self.pending: list[str] = []    # arguments seen before the name


class ToolCallParser:
    """The tool calls and content of one choice's output, found incrementally as text arrives.

    ``feed(text)`` takes the next piece of the output (any split: a tag or a JSON token may be cut
    anywhere) and returns the ``ToolCallEvent``s it completes; ``finish()`` ends the output and
    returns the rest. A call's ``"call"`` event comes as soon as its function name is read (and is
    one of ``tools``), then its arguments in pieces as they arrive: the model's own characters of
    the arguments' JSON value, so the pieces concatenate to exactly the final ``arguments``, and
    the same text gives the same calls and content however it was split (the whole response is
    this parser fed the whole text). Text that may still turn into a call (a partial
    ``<tool_call>`` tag, whitespace before it, a JSON object whose name is not read yet) is held
    back until it does or proves not to; the text of a call is never content.

    Formats by mode (``resolve_tool_choice``):
      * ``named``: the whole output is the arguments (the call's event comes first);
      * ``required``: a JSON array of ``{"name", "parameters"}`` objects (the grammar's shape);
      * ``auto``, Hermes: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>`` blocks, the
        text before the first one (whitespace before the tag dropped) is the content; text after
        the first call, outside blocks, is dropped;
      * ``auto``, Llama 3.x JSON: the output (after whitespace, optionally ``<|python_tag|>``) is
        ``{"name": N, "parameters"|"arguments": {...}}``, several separated by ``;``; what follows
        the last call is dropped;
      * ``none``: everything is content.
    An object whose name is not one of ``tools``, or that is not a call object, stays text (in
    ``auto``). Arguments given as a JSON string are sent decoded, in one piece. Arguments cut by
    ``max_tokens`` stay cut (finish_reason ``"length"``); in ``auto`` they are not checked against
    the schema. With ``parallel`` false only the first call is kept.

    Idea: vLLM's tool parsers (``extract_tool_calls_streaming`` of its Hermes and Llama 3 JSON
    parsers) re-parse the whole partial JSON at each step with ``partial_json_parser`` and send
    the growth of the re-serialized arguments, holding back the part that may still change; this
    parser instead scans each character once with a small JSON state machine (depth, strings,
    escapes), which needs no re-serialization and keeps the model's text exactly.
    """

    compact_at = 8192     # characters of read text kept before they are dropped (feed stays linear)

    def __init__(self, mode: str, tools: list[dict] | None, name: str | None = None, parallel: bool = True):
        self.mode, self.parallel = mode, parallel
        self.names = set(_functions(tools)) if tools else set()
        self.buf, self.pos = "", 0
        self.calls: list[dict] = []       # OpenAI's tool_calls, arguments complete once finished
        self.content: list[str] = []
        self._events: list[ToolCallEvent] = []
        self._obj: _CallObject | None = None
        self._format = ""                 # of the calls: hermes | json | array
        self._block = self._resume = 0    # tentative call: its text starts at _block, its opening ends at _resume
        self._finished = False
        if mode == "named":
            self._state = "named"
            self._open_call(name)
        else:
            self._state = {"auto": "start", "required": "array"}.get(mode, "text_only")

    # -- API ------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[ToolCallEvent]:
        """Events completed by ``text``, the next piece of the output."""
        if self._finished:
            raise ValueError("ToolCallParser.feed after finish()")
        self.buf += text
        self._run(final=False)
        self._compact()
        return self._take()

    def finish(self) -> list[ToolCallEvent]:
        """Events of what was held back, at the end of the output."""
        if not self._finished:
            self._finished = True
            self._run(final=True)
            if self.mode == "required" and not self.calls:
                self._content(self.buf)       # no call at all (cut early): the text as it is
        return self._take()

    def result(self) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` after ``finish()``: content is ``None`` when calls were made and
        no text came with them."""
        content = "".join(self.content)
        return (content or None) if self.calls else content, self.calls

    # -- machinery ------------------------------------------------------------------------------

    def _compact(self) -> None:
        """Drop the text no state can look back at (all but a tentative call's, and, in
        ``required``, all before the first call: ``finish()`` may return it as content), once
        over ``compact_at`` characters; every index shifts with it."""
        if self.mode == "required" and not self.calls:
            return
        keep = self._block if self._state in ("block_open", "object") else self.pos
        if keep < self.compact_at:
            return
        self.buf = self.buf[keep:]
        self.pos -= keep
        self._block -= keep
        self._resume -= keep
        if self._obj is not None:
            self._obj.key_start -= keep
            self._obj.value_start -= keep
            self._obj.sent_to -= keep

    def _take(self) -> list[ToolCallEvent]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if text:
            self.content.append(text)
            self._events.append(ToolCallEvent("content", text))

    def _open_call(self, name: str) -> int:
        index = len(self.calls)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        self._events.append(ToolCallEvent("call", name, index, call_id))
        return index

    def _arguments(self, index: int, text: str) -> None:
        if text:
            self.calls[index]["function"]["arguments"] += text
            self._events.append(ToolCallEvent("arguments", text, index))

    def _skip(self, chars: str) -> int:
        j, b = self.pos, self.buf
        while j < len(b) and b[j] in chars:
            j += 1
        return j

    def _run(self, final: bool) -> None:
        while getattr(self, "_s_" + self._state)(final):
            pass

    # every state: True when it moved on (run again), False when it needs more text (or, final, is done)

    def _s_text_only(self, final):
        self._content(self.buf[self.pos:])
        self.pos = len(self.buf)
        return False

    def _s_named(self, final):
        self._arguments(0, self.buf[self.pos:])
        self.pos = len(self.buf)
        return False

    def _s_ignore(self, final):
        self.pos = len(self.buf)
        return False

    def _s_start(self, final):        # auto: Llama 3 JSON at the start, else text
        j = self._skip(_WS)
        rest = self.buf[j:]
        if not rest and not final:
            return False
        self._format, self._block = "json", self.pos
        if rest.startswith(PYTHON_TAG):
            self.pos = self._resume = j + len(PYTHON_TAG)
            self._state = "block_open"
        elif rest.startswith("{"):
            self.pos, self._resume = j, j + 1      # not a call: text again after its "{"
            self._state = "block_open"
        elif rest and PYTHON_TAG.startswith(rest) and not final:
            return False
        else:
            self._state = "text"
        return True

    def _s_text(self, final):         # auto before any call: content, watching for <tool_call>
        b, p = self.buf, self.pos
        i = b.find(TOOL_CALL_TAG, p)
        if i >= 0:
            kept = b[p:i].rstrip(_WS)
            self._content(kept)
            self._format, self._block = "hermes", p + len(kept)
            self.pos = self._resume = i + len(TOOL_CALL_TAG)
            self._state = "block_open"
            return True
        if final:
            self._content(b[p:])
            self.pos = len(b)
            return False
        hold = next((k for k in range(min(len(TOOL_CALL_TAG) - 1, len(b) - p), 0, -1)
                     if b.endswith(TOOL_CALL_TAG[:k])), 0)
        kept = b[p:len(b) - hold].rstrip(_WS)
        self._content(kept)
        self.pos = p + len(kept)
        return False

    def _s_block_open(self, final):   # after <tool_call> / <|python_tag|> / before "{": the object
        j = self._skip(_WS)
        if j == len(self.buf):
            if final:
                self._fail()
                return True
            return False
        if self.buf[j] != "{":
            self._fail()
            return True
        self._obj = _CallObject()
        self.pos = j + 1
        self._state = "object"
        return True

    def _s_between_hermes(self, final):
        i = self.buf.find(TOOL_CALL_TAG, self.pos)
        if i < 0:
            self.pos = max(self.pos, len(self.buf) - len(TOOL_CALL_TAG) + 1)
            return False
        self._block, self.pos = i, i + len(TOOL_CALL_TAG)
        self._resume = self.pos
        self._state = "block_open"
        return True

    def _s_between_json(self, final):    # Llama 3 JSON: calls separated by ";"
        return self._next_object(_WS + ";")

    def _next_object(self, separators: str) -> bool:
        # past the separators, the next call object opens ("{"), else the rest is ignored
        j = self._skip(separators)
        if j == len(self.buf):
            self.pos = j
            return False
        if self.buf[j] != "{":
            self._state = "ignore"
            return True
        self._block, self.pos = j, j
        self._state = "block_open"
        return True

    def _s_array(self, final):        # required: "[" then call objects
        j = self._skip(_WS)
        if j == len(self.buf):
            return False
        self._format = "array"
        self.pos = j + 1
        self._state = "array_item" if self.buf[j] == "[" else "ignore"
        return True

    def _s_array_item(self, final):      # required: call objects separated by ","
        return self._next_object(_WS + ",")

    def _fail(self) -> None:
        """The tentative call is not one: before any call (auto) its opening becomes content and
        the text after it is read again as text; after a call, it is skipped. A call whose name
        was read ends where its text stops making sense."""
        obj, self._obj = self._obj, None
        if obj is not None and obj.index is not None:
            self._after_call()
            return
        if self.mode == "auto" and not self.calls:
            self._content(self.buf[self._block:self._resume])
            self.pos = self._resume
            self._state = "text"
        elif self._format == "hermes":
            self.pos = self._resume
            self._state = "between_hermes"
        else:
            self._state = "ignore"

    def _after_call(self) -> None:
        self._obj = None
        if not self.parallel:
            self._state = "ignore"
        else:
            self._state = {"hermes": "between_hermes", "json": "between_json", "array": "array_item"}[self._format]

    def _s_object(self, final):
        o, b, p = self._obj, self.buf, self.pos
        n = len(b)
        while p < n:
            ch, st = b[p], o.state
            if st == "value":
                end = self._value_char(o, ch, p)
                if end is None:
                    p += 1
                    continue
                self.pos = end
                if not self._value_done(o, end):
                    return True
                p = end
                continue
            if ch in _WS and st != "key":
                p += 1
                continue
            if st == "key_or_end":
                if ch == '"':
                    o.state, o.key_start, o.escaped = "key", p, False
                elif ch == "}":
                    self.pos = p + 1
                    self._close(o)
                    return True
                else:
                    break
            elif st == "key":
                if o.escaped:
                    o.escaped = False
                elif ch == "\\":
                    o.escaped = True
                elif ch == '"':
                    try:
                        o.key = json.loads(b[o.key_start:p + 1])
                    except ValueError:
                        break
                    o.state = "colon"
            elif st == "colon":
                if ch != ":":
                    break
                o.state = "value_start"
            elif st == "value_start":
                if ch != '"' and ch not in _VALUE_START:
                    break
                o.kind = "name" if o.key == "name" and o.name is None else \
                    "arguments" if o.key in ("arguments", "parameters") and not o.has_arguments else "other"
                o.shape = "string" if ch == '"' else "compound" if ch in "{[" else "scalar"
                if o.kind == "name" and o.shape != "string":
                    break
                o.has_arguments = o.has_arguments or o.kind == "arguments"
                o.value_start = o.sent_to = p
                o.depth, o.in_string, o.escaped = (1 if o.shape == "compound" else 0), o.shape == "string", False
                o.state = "value"
            elif st == "after_value":
                if ch == ",":
                    o.state = "key_or_end"
                elif ch == "}":
                    self.pos = p + 1
                    self._close(o)
                    return True
                else:
                    break
            p += 1
        else:   # the text so far is scanned
            self.pos = p
            if o.state == "value" and o.kind == "arguments" and o.shape != "string":
                self._send_arguments(o, p)
            if not final:
                return False
            if o.state == "value" and o.shape == "scalar":
                self._value_done(o, p)
            if o.index is not None:     # a call cut short: it stays as it is
                self._obj = None
                self._state = "ignore"
                return True
        self.pos = p
        self._fail()        # not a call object (or, final, one cut before its name)
        return True

    @staticmethod
    def _value_char(o: _CallObject, ch: str, p: int) -> int | None:
        """The end index of the value if ``ch`` at ``p`` ends it, else None (``ch`` belongs to it)."""
        if o.shape == "scalar":
            return None if ch in _SCALAR else p
        if o.in_string:
            if o.escaped:
                o.escaped = False
            elif ch == "\\":
                o.escaped = True
            elif ch == '"':
                o.in_string = False
                if o.shape == "string":
                    return p + 1
            return None
        if ch == '"':
            o.in_string = True
        elif ch in "{[":
            o.depth += 1
        elif ch in "}]":
            o.depth -= 1
            if o.depth == 0:
                return p + 1
        return None

    def _value_done(self, o: _CallObject, end: int) -> bool:
        """A value ended at ``end``; False when it makes the object no call (``_fail`` was run)."""
        o.state = "after_value"
        raw = self.buf[o.value_start:end]
        if o.kind == "name":
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            if name not in self.names:
                self._fail()
                return False
            o.name = name
            o.index = self._open_call(name)
            self._arguments(o.index, "".join(o.pending))
            o.pending.clear()
        elif o.kind == "arguments":
            if o.shape == "string":
                try:
                    decoded = json.loads(raw)
                except ValueError:
                    decoded = raw
                self._send(o, decoded)
            else:
                self._send_arguments(o, end)
        return True

    def _send_arguments(self, o: _CallObject, upto: int) -> None:
        self._send(o, self.buf[o.sent_to:upto])
        o.sent_to = upto

    def _send(self, o: _CallObject, text: str) -> None:
        if o.index is None:
            o.pending.append(text)
        else:
            self._arguments(o.index, text)

    def _close(self, o: _CallObject) -> None:
        if o.name is None:
            self._fail()
            return
        if not o.has_arguments:
            self._arguments(o.index, "{}")
        self._after_call()


def parse_tool_calls(text: str, mode: str, tools: list[dict] | None, name: str | None,
                     parallel: bool = True) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a completed output: ``ToolCallParser`` fed the whole text."""
    if mode == "none" or not tools:
        return text, []
    parser = ToolCallParser(mode, tools, name, parallel)
    parser.feed(text)
    parser.finish()
    return parser.result()
