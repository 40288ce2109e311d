"""OpenAI tool calling over folio's structured outputs: the constraint a ``tool_choice`` needs, and
the parser that turns a completion into ``message.tool_calls``.

``tool_choice`` (OpenAI's API; vLLM's ``serving_chat.py`` behaves the same way):

* ``"none"``: the tools are not rendered and no call is parsed; the output is text.
* ``"auto"`` (the default when ``tools`` are given): the model's chat template renders the tools;
  the model writes either text or calls in the template's format, which ``parse_tool_calls``
  understands in two forms:
    - Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one block per
      call; text before the first block is the message's content);
    - Llama 3.x JSON: the whole output is ``{"name": ..., "parameters": {...}}`` (or
      ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``.
  Nothing is enforced: a malformed call is returned as text.
* ``"required"``: the output is constrained (``tool_constraint``) to a JSON array of
  ``{"name": one of the functions, "parameters": that function's parameters schema}``, at least one
  item (exactly one when ``parallel_tool_calls`` is false): every call's arguments validate.
* ``{"type": "function", "function": {"name": N}}``: the output is constrained to N's parameters
  schema; it is the call's arguments.

The response carries ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``,
``function.arguments`` as a JSON string) and ``finish_reason`` ``"tool_calls"``; a stream sends the
calls as OpenAI does, in ``delta.tool_calls`` items with ``index``, the first of each call with its
id, type and name.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .protocol import APIError

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _functions(tools: list[dict]) -> dict[str, dict]:
    """``name -> parameters schema`` of the request's tools. Raises ``APIError(400)``."""
    out = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise APIError(400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
        params = f.get("parameters") or EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[f["name"]] = params
    return out


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


def _call(name: str, arguments) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _json_calls(text: str, names: set[str]) -> list[dict] | None:
    """Llama 3.x JSON calls filling the whole ``text``, or ``None``."""
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>"):].lstrip()
    dec, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(s):
        try:
            obj, pos = dec.raw_decode(s, pos)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(args, (dict, str)):
            return None
        calls.append(_call(obj["name"], args))
        while pos < len(s) and s[pos] in " \t\r\n;":
            pos += 1
    return calls or None


def parse_tool_calls(text: str, mode: str, tools: list[dict] | None, name: str | None,
                     parallel: bool = True) -> tuple[str | None, list[dict]]:
    """``(content, tool_calls)`` of a completed output (see the module docstring)."""
    if mode == "none" or not tools:
        return text, []
    if mode == "named":
        return None, [_call(name, text)]
    if mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut by max_tokens: the text as it is
        return None, [_call(i["name"], i.get("parameters", {})) for i in items if isinstance(i, dict)]
    names = set(_functions(tools))
    blocks = _HERMES.findall(text)
    if blocks:
        calls = []
        for b in blocks:
            try:
                obj = json.loads(b)
            except ValueError:
                return text, []
            if not isinstance(obj, dict) or obj.get("name") not in names:
                return text, []
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        content = text[:text.index("<tool_call>")].strip()
        return (content or None), (calls if parallel else calls[:1])
    calls = _json_calls(text, names)
    if calls:
        return None, (calls if parallel else calls[:1])
    return text, []


def might_be_tool_call(text: str) -> bool:
    """Whether a streamed output that starts with ``text`` could still turn into calls (``auto``):
    the stream holds it back until the end then."""
    s = text.lstrip()
    return not s or s[0] in "{<" or "<tool_call>".startswith(s[:11]) or "<|python_tag|>".startswith(s[:14])
