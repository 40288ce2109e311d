"""Streaming detokenization with the real default tokenizer: whole characters only, stop strings
across and inside tokens, held-back text released exactly once, deltas joining to the final text.

Every test runs on both paths of ``IncrementalDetokenizer``: the byte-level one (token bytes from
a table, one UTF-8 decode) and the sliding window of tokenizer calls; the reference is always the
library's own ``decode`` of the whole id list."""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from folio.model.tokenizer import Tokenizer
from folio.runtime.scheduler.detokenizer import IncrementalDetokenizer, TokenBytes
from folio.runtime.common.sampling_params import SamplingParams

BYTE_LEVEL = [True]


@pytest.fixture(autouse=True, params=[True, False], ids=["byte-level", "window"])
def detok_path(request):
    BYTE_LEVEL[0] = request.param
    yield request.param
    BYTE_LEVEL[0] = True


def Detok(tok, prompt, params):
    return IncrementalDetokenizer(tok, prompt, params, byte_level=BYTE_LEVEL[0])


PROMPT_TEXT = "Tell me something:"
SAMPLE_TEXTS = ["héllo 😀 世界 ok", "The answer is: 2018-01-22 12:12:53.", " Paris.\n\nThe capital",
                "日本語のテキスト 🎉🎉 naïve café", "def f(x):\n    return x  # ✓"]


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return Tokenizer.from_pretrained(default_model_dir)


def stream(tok, ids, params=None, chunks=None, prompt=None, stop_terminated=False):
    """Feed ``ids`` (in ``chunks`` sizes), return (deltas, final text, stop string, detok)."""
    params = params or SamplingParams()
    prompt = tok.encode(PROMPT_TEXT) if prompt is None else prompt
    d = Detok(tok, prompt, params)
    deltas, seen, stop, i = [], "", None, 0
    chunks = chunks or [1] * len(ids)
    for n in chunks:
        part = ids[i:i + n]
        i += n
        if not part:
            continue
        stop = d.update(part, stop_terminated=stop_terminated and i >= len(ids))
        assert d.output_text.startswith(seen), "released text was taken back"
        deltas.append(d.output_text[len(seen):])
        seen = d.output_text
        if stop is not None:
            break
    final = d.finish()
    assert final.startswith(seen)
    deltas.append(final[len(seen):])
    return deltas, final, stop, d


def test_whole_characters_only(tok):
    for text in SAMPLE_TEXTS:
        ids = tok.encode(text)
        deltas, final, stop, _ = stream(tok, ids)
        assert stop is None
        assert "".join(deltas) == final == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)


def test_split_character_waits_for_its_last_byte(tok):
    ids = tok.encode(" 😀")
    assert len(ids) >= 2 and "\ufffd" in tok.decode(ids[:1])  # the emoji spans tokens
    d = Detok(tok, [], SamplingParams())
    d.update(ids[:1])
    assert "\ufffd" not in d.output_text
    d.update(ids[1:])
    assert d.output_text == " 😀"


def _byte_pool(tok):
    pool = set()
    for text in SAMPLE_TEXTS:
        pool.update(tok.encode(text))
    pool.update(range(0, 17))  # special tokens
    return sorted(pool)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_deltas_join_to_full_decode(tok, data):
    pool = _byte_pool(tok)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), st.integers(0, tok.vocab_size - 1)),
                             min_size=1, max_size=40))
    skip = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
    deltas, final, stop, _ = stream(tok, ids, SamplingParams(skip_special_tokens=skip), chunks)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == final == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def _pieces(tok, ids):
    """Start and end character offsets of each token in the decoded text (tokens whole chars)."""
    ends = [len(tok.decode(ids[:i + 1])) for i in range(len(ids))]
    return [0] + ends[:-1], ends


def test_stop_string_ending_inside_a_token(tok):
    text = " Paris.\n\nThe answer is: 2018"
    ids = tok.encode(text)
    starts, ends = _pieces(tok, ids)
    stop = "The ans"  # " answer" is one token: the stop ends inside it
    end = text.find(stop) + len(stop)
    assert not any(e == end for e in ends), "stop must end mid-token for this test"
    deltas, final, got, _ = stream(tok, ids, SamplingParams(stop=[stop]))
    assert got == stop
    assert final == "".join(deltas) == text[: text.find(stop)]


def test_stop_string_spanning_three_tokens(tok):
    text = " Paris.\n\nThe answer is: 2018-01-22"
    ids = tok.encode(text)
    starts, ends = _pieces(tok, ids)
    # from inside token k to inside token k+2
    k = next(i for i in range(len(ids) - 2)
             if ends[i] - starts[i] >= 2 and ends[i + 2] - starts[i + 2] >= 2)
    stop = text[starts[k] + 1: ends[k + 2] - 1]
    assert text.find(stop) == starts[k] + 1
    for include in (False, True):
        deltas, final, got, _ = stream(tok, ids, SamplingParams(stop=[stop], include_stop_str_in_output=include))
        assert got == stop
        cut = text.find(stop) + (len(stop) if include else 0)
        assert final == "".join(deltas) == text[:cut]


def test_held_back_text_released_once_when_ruled_out(tok):
    text = "The answer is: 2018"
    ids = tok.encode(text)
    stop = "answer is: 9"
    d = Detok(tok, [], SamplingParams(stop=[stop]))
    seen = ""
    for i, t in enumerate(ids):
        assert d.update([t]) is None
        out = d.output_text
        assert out.startswith(seen)
        decoded = tok.decode(ids[:i + 1])
        # everything except a tail that is a proper prefix of the stop string is out
        tail = decoded[len(out):]
        assert stop.startswith(tail) and len(tail) < len(stop)
        seen = out
    assert seen == text  # "2" ruled the stop string out
    assert d.finish() == text


def test_finish_releases_held_back_text(tok):
    ids = tok.encode("The answ")
    deltas, final, stop, _ = stream(tok, ids, SamplingParams(stop=["answer"]))
    assert stop is None
    assert deltas[-1].endswith("answ")  # held until finish
    assert "".join(deltas) == final == "The answ"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("one two three four")
    _, final, stop, _ = stream(tok, ids, SamplingParams(stop=["four", "two"]), chunks=[len(ids)])
    assert stop == "two" and final == "one "


def test_stop_strings_not_checked_before_min_tokens(tok):
    ids = tok.encode("a, b, c, d")
    _, final, stop, _ = stream(tok, ids, SamplingParams(stop=[","], min_tokens=3))
    n_first = len(tok.decode(ids[:3]))
    assert stop == "," and final == "a, b, c, d"[: "a, b, c, d".index(",", n_first - 1)]


def test_stop_token_and_eos_text_left_out(tok):
    ids = tok.encode("Hello world") + [2]  # 2 = <|im_end|> (EOS)
    p = SamplingParams(skip_special_tokens=False)
    _, final, _, _ = stream(tok, ids, p, stop_terminated=True)
    assert final == "Hello world"
    _, final, _, _ = stream(tok, ids, p.clone(include_stop_str_in_output=True), stop_terminated=True)
    assert final == "Hello world<|im_end|>"
    world = tok.encode(" world")
    assert len(world) == 1
    _, final, _, _ = stream(tok, tok.encode("Hello world"), SamplingParams(stop_token_ids=world))
    assert final == "Hello"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_stop_cut_and_deltas(tok, data):
    text = data.draw(st.sampled_from(SAMPLE_TEXTS))
    ids = tok.encode(text)
    a = data.draw(st.integers(0, len(text) - 1))
    b = data.draw(st.integers(a + 1, min(len(text), a + 8)))
    stop = text[a:b]
    include = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(ids), max_size=len(ids)))
    deltas, final, got, _ = stream(tok, ids, SamplingParams(stop=[stop], include_stop_str_in_output=include),
                                   chunks)
    i = text.find(stop)
    assert got == stop
    assert final == "".join(deltas) == text[: i + (len(stop) if include else 0)]
    assert not any("\ufffd" in d for d in deltas)


def test_token_bytes_concatenate_to_the_library_decode(tok):
    # the byte-level path's premise, on the whole vocabulary in random sequences with special
    # tokens: decode(ids) == UTF-8 decode (invalid bytes replaced) of the joined token bytes
    rng = random.Random(0)
    for skip in (True, False):
        table = TokenBytes(tok.hf, skip)
        for _ in range(300):
            ids = [rng.randrange(tok.vocab_size) if rng.random() < 0.9 else rng.randrange(17)
                   for _ in range(rng.randrange(1, 24))]
            joined = b"".join(table[i] for i in ids)
            assert joined.decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=skip), ids


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_add_token_equals_update(tok, data):
    # the output processor's per-step call gives the same texts as update + take_new_text
    pool = _byte_pool(tok)
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=30))
    stops = data.draw(st.sampled_from([[], ["er"], [" ", "é"]]))
    params = SamplingParams(stop=stops, skip_special_tokens=data.draw(st.booleans()))
    a, b = Detok(tok, [5], params), Detok(tok, [5], params)
    for t in ids:
        ta = a.add_token(t)
        b.update([t])
        assert ta == b.take_new_text()
        assert a.output_text == b.output_text and a.finished == b.finished
        if a.finished:
            break
    assert a.finish() == b.finish()
