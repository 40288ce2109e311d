"""Whether a text is a prefix of some JSON document (RFC 8259), for outputs cut by ``max_tokens``.

Independent of any grammar engine: the text is scanned for its open strings and brackets, then
completed with each of a few short endings and closed; ``json.loads`` (the standard library's
parser) decides. A prefix of valid JSON always has such a completion (an open escape or ``\\u``
sequence, a literal or number cut short, a key without its value, a trailing comma), and a text
that is not one has none: no completion can repair what is already wrong.
"""

from __future__ import annotations

import json

# what may be missing before the closing brackets: nothing, the rest of a number, literal or
# key-value pair, or a whole value after a comma or colon
_FILLERS = ("", "0", ":0", '"":0', "e", "ue", "rue", "alse", "lse", "se", "l", "ll", "ull")


def json_prefix_ok(text: str, top: str | None = None) -> bool:
    """True when ``text`` extends to a valid JSON document (whose top level is the bracket ``top``
    ``"{"`` or ``"["`` when given: leading whitespace allowed)."""
    if top is not None and not text.lstrip().startswith(top):
        return False
    stack, in_str, esc, hex_left = [], False, False, 0
    for ch in text:
        if in_str:
            if hex_left:
                hex_left -= 1
            elif esc:
                esc, hex_left = False, 4 if ch == "u" else 0
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            stack.append(ch)
        elif ch in "]}":
            if not stack or "[{"["]}".index(ch)] != stack.pop():
                return False
    closers = "".join("}" if c == "{" else "]" for c in reversed(stack))
    if in_str:  # finish the escape (a valid hex digit or escape letter) and the string
        heads = ["0" * hex_left + '"'] if hex_left else (['n"'] if esc else ['"'])
    else:
        heads = [""]
    for head in heads:
        for filler in _FILLERS:
            try:
                json.loads(text + head + filler + closers)
            except json.JSONDecodeError:
                continue
            return True
    return False
