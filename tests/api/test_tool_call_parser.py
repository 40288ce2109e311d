"""The incremental tool-call parser (``folio.api.tool_calls.ToolCallParser``) on hand-written token
streams, no server.

Expectations are written by hand per case (content, each call's name and its exact arguments
text), plus two equivalences: every split of the same text (the hand-written tokens, one character
at a time, the whole text at once, any cut into two pieces) gives the same calls and content, and
the streamed pieces concatenate to the final arguments. The split tokens follow SmolLM2's
tokenizer (``<tool_call>`` is five tokens there: ``<``, ``tool``, ``_``, ``call``, ``>``).
"""

from __future__ import annotations

import json

import pytest

from folio.api.runs import _event_deltas
from folio.api.tool_calls import ToolCallParser, parse_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]


def stream(tokens, mode="auto", name=None, parallel=True, compact_at=None):
    """Feed ``tokens`` one by one: ``(events per token (the last item: finish()), parser)``."""
    p = ToolCallParser(mode, TOOLS, name, parallel)
    if compact_at is not None:
        p.compact_at = compact_at
    per_token = [p.feed(t) for t in tokens] + [p.finish()]
    return per_token, p


def check_stream(tokens, content, calls, mode="auto", name=None, parallel=True):
    """Feed the tokens; the events and the result must be ``content`` and ``calls``
    (``[(name, exact arguments text)]``), however the text is split."""
    per_token, p = stream(tokens, mode, name, parallel)
    events = [e for evs in per_token for e in evs]
    # the result, and the events that built it
    got_content, got_calls = p.result()
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    assert "".join(e.text for e in events if e.kind == "content") == (content or "")
    headers = [e for e in events if e.kind == "call"]
    assert [(e.index, e.text, e.call_id) for e in headers] == \
        [(i, c["function"]["name"], c["id"]) for i, c in enumerate(got_calls)]
    assert len({c["id"] for c in got_calls}) == len(got_calls) and all(c["id"].startswith("call_") for c in got_calls)
    for i, (_, arguments) in enumerate(calls):
        positions = [k for k, e in enumerate(events) if e.index == i]
        assert events[positions[0]].kind == "call"      # the name before any argument
        assert "".join(events[k].text for k in positions[1:]) == arguments
    # the same text split otherwise: the same result (ids aside)
    text = "".join(tokens)
    expect = (content, calls)
    splits = [list(text), [text]] + [[text[:k], text[k:]] for k in range(1, len(text))]
    for pieces in splits:
        for compact_at in (None, 1):      # also with the read text dropped after every piece
            _, q = stream(pieces, mode, name, parallel, compact_at)
            c2, calls2 = q.result()
            assert (c2, [(c["function"]["name"], c["function"]["arguments"]) for c in calls2]) == expect, pieces
    c3, calls3 = parse_tool_calls(text, mode, TOOLS, name, parallel)
    assert (c3, [(c["function"]["name"], c["function"]["arguments"]) for c in calls3]) == expect
    return per_token


HERMES_TOKENS = ["Let", " me", " check", ".", "\n", "<", "tool", "_", "call", ">", "\n", '{"', "name", '":', ' "', "get",
                 "_", "weather", '",', ' "', "arguments", '":', ' {"', "city", '":', ' "', "Par", "is", '",', ' "', "unit",
                 '":', ' "', "c", '"', "}}", "\n", "</", "tool", "_", "call", ">", "\n", "<tool_call>",
                 '{"name": "get_time", ', '"arguments": {"zone": "C', 'ET"}}', "</tool_call>"]


def test_hermes_text_then_two_calls_split_at_awkward_boundaries():
    per_token = check_stream(HERMES_TOKENS, "Let me check.",
                             [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", '{"zone": "CET"}')])
    # the content streams as it comes (the newline before the tag is held, then dropped) ...
    assert [e.text for e in per_token[0]] == ["Let"] and [e.text for e in per_token[3]] == ["."]
    assert all(not evs for evs in per_token[4:18])          # '\n<tool_call>\n{"name": "get_weather' held back
    # ... the call's first event as soon as its name is read, then its arguments piece by piece
    (header,) = per_token[18]                                 # the token that closes "get_weather"
    assert (header.kind, header.text, header.index) == ("call", "get_weather", 0)
    pieces = [e.text for evs in per_token for e in evs if e.kind == "arguments" and e.index == 0]
    assert len(pieces) > 5 and pieces[0] == '{"'          # from the token ' {"', its arguments' part
    # a piece never holds text outside the arguments
    assert all("}}" not in p and "tool" not in p for p in pieces)


def test_tool_text_never_reaches_content():
    _, p = stream(HERMES_TOKENS)
    content = "".join(p.content)
    for fragment in ("<", "tool", "{", "get_", "Paris", "\n"):
        assert fragment not in content


def test_llama3_json_calls_python_tag_split_and_separators():
    tokens = ["<|python", "_tag|>", '{"name": "get_time", "parameters": {"zone": "UT', 'C"}}', "; ",
              '{"name": "get_weather"', ', "parameters": {"city": "Oslo", "unit": "f"}}']
    check_stream(tokens, None, [("get_time", '{"zone": "UTC"}'), ("get_weather", '{"city": "Oslo", "unit": "f"}')])
    # SmolLM2's split of a bare call, leading whitespace, and text after the calls dropped
    tokens = [" \n", '{"', "name", '":', ' "', "get", "_", "time", '",', ' "', "parameters", '":', ' {"', "zone", '":',
              ' "', "UTC", '"', "}}", "\n", "Done", "."]
    check_stream(tokens, None, [("get_time", '{"zone": "UTC"}')])


def test_arguments_before_the_name_wait_for_it():
    tokens = ['{"parameters": {"zone": ', '"UTC"}, ', '"name": "get_time"}']
    per_token = check_stream(tokens, None, [("get_time", '{"zone": "UTC"}')])
    assert per_token[0] == [] and per_token[1] == []
    assert [e.kind for e in per_token[2]] == ["call", "arguments"]


def test_required_array_with_brackets_and_escapes_inside_strings():
    text = '[{"name": "get_weather", "parameters": {"city": "a,b}]\\"x", "unit": "f"}}, ' \
           '{"name": "get_time", "parameters": {"zone": "[Z]"}}]'
    tokens = [text[i:i + 3] for i in range(0, len(text), 3)]
    check_stream(tokens, None, [("get_weather", '{"city": "a,b}]\\"x", "unit": "f"}'),
                                ("get_time", '{"zone": "[Z]"}')], mode="required")
    # parallel_tool_calls false: the first call only
    check_stream(tokens, None, [("get_weather", '{"city": "a,b}]\\"x", "unit": "f"}')], mode="required",
                 parallel=False)


def test_named_function_streams_the_whole_output_as_arguments():
    tokens = ['{"', "zone", '":', ' "', "UTC", '"}']
    per_token = check_stream(tokens, None, [("get_time", '{"zone": "UTC"}')], mode="named", name="get_time")
    assert [e.kind for e in per_token[0]] == ["call", "arguments"]    # the name is known from the start
    assert all([e.kind for e in evs] == ["arguments"] for evs in per_token[1:-1])


def test_arguments_given_as_a_json_string_are_decoded():
    check_stream(['{"name": "get_time", "arguments": "{\\"zone', '\\": \\"UTC\\"}"}'], None,
                 [("get_time", '{"zone": "UTC"}')])


def test_a_call_without_arguments_gets_an_empty_object():
    check_stream(["<tool_call>", '{"name": "get_time"}', "</tool_call>"], None, [("get_time", "{}")])


@pytest.mark.parametrize("text", [
    '{"name": "unknown", "parameters": {}}',          # not one of the tools
    '{"answer": 42}',                                  # JSON, not a call
    '{"name": 3}',
    "Sunny, 20 degrees.",
    "a < b and {c} <tool_calling> here",               # a tag's prefix that is not the tag
    '<tool_call>{"name": </tool_call>',                # broken call
    "x <tool_cal",                                     # cut inside a tag's prefix
    '<tool_call>{"na',                                 # cut before the name
    "  trailing spaces  \n",
    "",
])
def test_text_that_is_not_a_call_is_content_exactly(text):
    tokens = [text[i:i + 2] for i in range(0, len(text), 2)]
    check_stream(tokens, text, [])


def test_cut_by_max_tokens_inside_the_arguments_keeps_the_call():
    check_stream(["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Pa'], None,
                 [("get_weather", '{"city": "Pa')])
    check_stream(['[{"name": "get_time", "parameters": {"zo'], None, [("get_time", '{"zo')], mode="required")
    # required, cut before any name: the text is the content (as without tools)
    check_stream(['[{"na'], '[{"na', [], mode="required")


def test_after_a_call_broken_blocks_are_skipped_and_auto_parallel_false_keeps_one():
    tokens = ["<tool_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>", "<tool_call>", "oops",
              "</tool_call>", "<tool_call>", '{"name": "get_weather", "arguments": {"city": "X"}}', "</tool_call>"]
    check_stream(tokens, None, [("get_time", "{}"), ("get_weather", '{"city": "X"}')])
    check_stream(tokens, None, [("get_time", "{}")], parallel=False)


def test_event_deltas_in_openais_shape():
    p2 = ToolCallParser("auto", TOOLS)
    events = p2.feed('Hi<tool_call>{"name": "get_time", "arguments": {"zone"') + p2.feed(': "UTC"}}') + p2.finish()
    deltas = _event_deltas(events)
    call_id = p2.calls[0]["id"]
    assert deltas == [
        {"content": "Hi"},
        {"tool_calls": [{"index": 0, "id": call_id, "type": "function",
                         "function": {"name": "get_time", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"zone": "UTC"}'}}]},
    ]


def test_a_long_output_keeps_little_text():
    """What was read is dropped: the buffer stays near ``compact_at``, however long the output."""
    prose = "word " * 20000
    tokens = [prose[i:i + 5] for i in range(0, len(prose), 5)] + ["<tool_call>", '{"name": "get_time", ',
                                                                  '"arguments": {"zone": "', "x" * 50000, '"}}']
    p = ToolCallParser("auto", TOOLS)
    longest = 0
    for t in tokens:
        p.feed(t)
        longest = max(longest, len(p.buf))
    p.finish()
    assert longest < p.compact_at + 50000 + 100        # the compaction threshold plus the largest token
    content, (call,) = p.result()
    assert content == prose.rstrip() and call["function"]["arguments"] == '{"zone": "' + "x" * 50000 + '"}'
