"""The worker's grammar compiles (``runtime/worker/grammar_matchers.py``): on their own pool, each
bounded from its own start, once per grammar, kept while in use; grammars that admit no output
refused (``runtime/common/grammar.py``).

Compiles that must take a known time are stood in for by a function that waits on an event or
spins (``compile_grammar`` replaced), so no assertion depends on how fast llguidance is.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support.serve_helpers import poll_until

from folio.runtime.common import grammar as G
from folio.runtime.common.sampling_params import SamplingParams, StructuredOutputsParams
from folio.runtime.worker import grammar_matchers as GM
from folio.runtime.worker.sampler import SamplingState


@pytest.fixture(scope="module")
def tokenizer_json(default_model_dir):
    from folio.model.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(default_model_dir)
    return tok.hf.to_str(), list(tok.eos_token_ids)


def _so(**kw):
    return StructuredOutputsParams(**kw)


def _key(so, eos):
    return G.grammar_key(so, eos)


def _results(gm, keys, deadline_s=60):
    """Poll ``gm`` until every key of ``keys`` is answered; ``{key: error}``."""
    got = {}

    def answered():
        for r in gm.poll(0.05):
            got[r["key"]] = r["error"]
        return set(keys) <= set(got)
    poll_until(answered, deadline_s, f"answers for {len(keys)} grammars")
    return got


def test_grammars_that_admit_no_output_are_refused(tokenizer_json):
    text, eos = tokenizer_json
    gm = GM.GrammarMatchers(lambda: text)
    cases = {"cycle": _so(grammar="root ::= root"), "mutual": _so(grammar="root ::= a\na ::= root"),
             "ref": _so(json={"$ref": "#"}),
             "defs": _so(json={"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                               "$ref": "#/$defs/a"}),
             # satisfiable ones beside them: a recursive schema with a base case, the empty string
             "tree": _so(json={"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}),
             "empty": _so(grammar='root ::= ""'), "word": _so(regex="[a-z]+")}
    keys = {name: _key(so, eos) for name, so in cases.items()}
    for name, so in cases.items():
        gm.prepare(keys[name], so.to_dict(), eos)
    got = _results(gm, keys.values())
    for name in ("cycle", "mutual", "ref", "defs"):
        assert got[keys[name]] is not None and "admits no output" in got[keys[name]], (name, got[keys[name]])
        assert got[keys[name]].startswith("structured_outputs: invalid")
    for name in ("tree", "empty", "word"):
        assert got[keys[name]] is None, (name, got[keys[name]])
    gm.shutdown()


def test_a_compile_is_bounded_from_its_own_start_not_from_its_queueing(tokenizer_json, monkeypatch):
    text, eos = tokenizer_json
    real = G.compile_grammar
    names = []

    def compile_grammar(tok, grammar):
        names.append(threading.current_thread().name)
        if "hold" in grammar:
            time.sleep(0.6)              # holds its thread 0.6 s, using no CPU
        if "spin" in grammar:
            end = time.thread_time() + 0.5
            while time.thread_time() < end:   # 0.5 s of this thread's CPU time
                pass
        return real(tok, grammar)

    monkeypatch.setattr(GM, "compile_grammar", compile_grammar)
    gm = GM.GrammarMatchers(lambda: text, threads=1, timeout_s=0.2, wall_s=30.0)
    held, queued = _so(regex="hold[0-9]"), _so(regex="queued[0-9]")
    kh, kq = _key(held, eos), _key(queued, eos)
    gm.prepare(kh, held.to_dict(), eos)
    gm.prepare(kq, queued.to_dict(), eos)   # waits 0.6 s in the queue, three times its bound
    assert _results(gm, [kh, kq]) == {kh: None, kq: None}
    assert names == ["folio-grammar_0"] * 2  # on the pool's thread, one after the other
    # a compile that uses more CPU than its bound is refused, naming the bound
    spin = _so(regex="spin[0-9]")
    ks = _key(spin, eos)
    gm.prepare(ks, spin.to_dict(), eos)
    got = _results(gm, [ks])
    assert "took more than 0.2 s to compile" in got[ks]
    # known bad: answered at once, not compiled again
    n = len(names)
    gm.prepare(ks, spin.to_dict(), eos)
    assert gm.poll() == [{"key": ks, "error": got[ks]}] and len(names) == n
    # the wall-clock bound ends a compile that holds its thread without using CPU
    slow = GM.GrammarMatchers(lambda: text, threads=1, timeout_s=10.0, wall_s=0.2)
    slow.prepare(kh, held.to_dict(), eos)
    assert "did not compile within 0.2 s" in _results(slow, [kh])[kh]
    gm.shutdown()
    slow.shutdown()


def test_one_compile_per_grammar_kept_while_in_use(tokenizer_json, monkeypatch):
    text, eos = tokenizer_json
    calls = []
    real = G.compile_grammar
    monkeypatch.setattr(GM, "compile_grammar", lambda tok, g: calls.append(g) or real(tok, g))
    gm = GM.GrammarMatchers(lambda: text)
    so = _so(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    key = _key(so, eos)
    gm.prepare(key, so.to_dict(), eos)
    gm.prepare(key, so.to_dict(), eos)              # a second request of the same grammar
    assert _results(gm, [key]) == {key: None}
    gm.prepare(key, so.to_dict(), eos)              # compiled: answered without a compile
    assert gm.poll() == [{"key": key, "error": None}]
    assert len(calls) == 1
    # sequences attach copies of the compiled grammar, replayed over their tokens
    import tokenizers
    ids = tokenizers.Tokenizer.from_str(text).encode('{"a": 1', add_special_tokens=False).ids
    st = SamplingState(0, SamplingParams(), [1], ids, None, eos)
    gm.attach(st, key)
    assert st.matcher is not None and not st.matcher.is_error() and not st.matcher.is_accepting()
    assert st.matcher.consume_tokens(tokenizers.Tokenizer.from_str(text).encode("}", add_special_tokens=False).ids)
    assert st.matcher.is_accepting()
    # released: evictable, still usable; unknown: refused (a scheduler that did not wait)
    gm.release(key)
    gm.attach(SamplingState(1, SamplingParams(), [1], [], None, eos), key)
    with pytest.raises(G.GrammarError, match="not compiled on this worker"):
        gm.attach(SamplingState(2, SamplingParams(), [1], [], None, eos), "0" * 64)
    assert len(calls) == 1
    gm.shutdown()


def test_compiles_run_at_a_lower_priority(tokenizer_json, monkeypatch):
    import os
    text, eos = tokenizer_json
    seen = []
    real = G.compile_grammar
    monkeypatch.setattr(GM, "compile_grammar",
                        lambda tok, g: seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                        or real(tok, g))
    gm = GM.GrammarMatchers(lambda: text)
    so = _so(choice=["left", "right"])
    _ = gm.prepare(_key(so, eos), so.to_dict(), eos)
    _results(gm, [_key(so, eos)])
    assert seen == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + GM.GRAMMAR_NICE)]
    gm.shutdown()


def test_the_key_names_the_constraint_and_its_eos():
    a = _so(json={"type": "object", "properties": {"x": {}, "y": {}}})
    b = _so(json='{"properties": {"y": {}, "x": {}}, "type": "object"}')   # the same schema as text
    assert G.grammar_key(a, [2]) == G.grammar_key(b, [2]) != G.grammar_key(a, [3])
    assert G.grammar_key(a, [2]) != G.grammar_key(_so(json=a.json, disable_any_whitespace=True), [2])
    with pytest.raises(G.GrammarError, match="too large") as e:
        G.check_constraint(_so(regex="a" * (G.MAX_GRAMMAR_CHARS + 1)), "response_format")
    assert e.value.param == "response_format"
    G.check_constraint(_so(regex="a" * 1000))
    assert np.dtype(np.int32).itemsize * G.bitmask_words(49152) * 8 >= 49152
