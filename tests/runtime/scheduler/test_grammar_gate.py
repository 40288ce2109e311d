"""Constrained requests wait for their grammar outside the scheduler (``runtime/scheduler/grammar_gate.py``),
compiled once, by the worker, on its grammar pool (``runtime/worker/grammar_matchers.py``).

The engine runs in this process over the echo worker (``support.ipc_fake_runner.EchoRunner``: next
id = last id + 1, grammars compiled for real with the model's tokenizer). A compile that must last
until the test says so is stood in for by ``compile_grammar`` waiting on an event.
"""

from __future__ import annotations

import threading

import pytest
from support.ipc_fake_runner import EchoRunner
from support.serve_helpers import poll_until

from folio import LLM
from folio.runtime.common import grammar as G
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.sampling_params import SamplingParams, StructuredOutputsParams
from folio.runtime.scheduler.engine import LLMEngine
from folio.runtime.worker import grammar_matchers as GM

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture
def compiles(monkeypatch):
    """Every compile's thread name and grammar text; ``gate`` (an event) holds compiles whose text
    mentions ``held`` until it is set."""
    real = G.compile_grammar

    class Seen(list):
        gate = threading.Event()
    seen = Seen()
    gate = seen.gate

    def compile_grammar(tok, text):
        seen.append((threading.current_thread().name, text))
        if "held" in text:
            assert seen.gate.wait(60)
        return real(tok, text)

    monkeypatch.setattr(GM, "compile_grammar", compile_grammar)
    yield seen
    gate.set()


def _engine(**kw):
    cfg = EngineConfig(device="cpu", max_model_len=512, **kw)
    return LLMEngine(cfg, EchoRunner(cfg))


def _run(engine, until=None):
    """Step until ``until(deltas so far)`` or the engine is idle; ``{request id: [deltas]}``."""
    got: dict = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            got.setdefault(d.request_id, []).append(d)
        if until is not None and until(got):
            break
    return got


def _tokens(deltas):
    return [t for d in deltas for c in d.outputs for t in c.token_ids]


def test_a_request_waiting_for_its_grammar_does_not_delay_the_others(compiles):
    engine = _engine()
    held = StructuredOutputsParams(regex="held[0-9]+")
    engine.add_request("held", None, SamplingParams(max_tokens=4, structured_outputs=held), prompt_token_ids=[5])
    engine.add_request("plain", None, SamplingParams(max_tokens=30), prompt_token_ids=[100, 101])
    got = _run(engine, until=lambda g: g.get("plain") and g["plain"][-1].finished)
    # the plain request ran all its steps while the other one's compile was still running
    assert _tokens(got["plain"]) == list(range(102, 132))
    assert "held" not in got and engine.grammar_gate.num_held() == 1 and not engine.scheduler.requests.get("held")
    compiles.gate.set()
    got = _run(engine)
    assert _tokens(got["held"]) == [6, 7, 8, 9] and got["held"][-1].outputs[-1].finish_reason == "length"
    # compiled on the worker's grammar pool, never on the engine's (this) thread
    assert [name.startswith("folio-grammar") for name, _ in compiles] == [True]
    m = engine.get_metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"] and not engine.grammar_gate.has_held()


def test_each_grammar_compiles_once_and_is_released_when_unused(compiles):
    engine = _engine()
    so = StructuredOutputsParams(json=SCHEMA)
    for i in range(3):     # three requests, one of them with three samples: one grammar
        engine.add_request(f"r{i}", None, SamplingParams(n=3 if i == 1 else 1, max_tokens=3, structured_outputs=so),
                           prompt_token_ids=[7, 8])
    got = _run(engine)
    assert sorted(got) == ["r0", "r1", "r2"] and all(d[-1].finished and d[-1].error is None for d in got.values())
    assert len(compiles) == 1
    # a later request of the same grammar: the worker answers from what it kept, no compile
    engine.add_request("again", None, SamplingParams(max_tokens=2, structured_outputs=so), prompt_token_ids=[7])
    got = _run(engine)
    assert _tokens(got["again"]) == [8, 9] and len(compiles) == 1
    grammars = engine.executor.runner.grammars
    engine.add_request("plain", None, SamplingParams(max_tokens=2), prompt_token_ids=[7])
    _run(engine)             # (its plan tells the worker the grammar is no longer in use)
    key = G.grammar_key(so, engine.eos_token_ids)
    assert key not in grammars._pinned and key in grammars._spare


def test_a_bad_grammar_ends_its_request_with_the_error_and_is_refused_at_once_after(compiles):
    engine = _engine()
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nonsense"}}})
    engine.add_request("bad", None, SamplingParams(max_tokens=4, structured_outputs=bad), prompt_token_ids=[5])
    engine.add_request("plain", None, SamplingParams(max_tokens=4), prompt_token_ids=[5])
    got = _run(engine)
    (d,) = got["bad"]
    assert d.finished and d.error.startswith("structured_outputs: invalid json") and "nonsense" in d.error
    assert [c.finish_reason for c in d.outputs] == ["abort"] and _tokens(got["plain"]) == [6, 7, 8, 9]
    with pytest.raises(G.GrammarError, match="invalid json") as e:   # known bad: no request, no compile
        engine.add_request("bad2", None, SamplingParams(structured_outputs=bad), prompt_token_ids=[5])
    assert e.value.param == "structured_outputs" and "bad2" not in engine.scheduler.requests
    assert len(compiles) == 1
    # LLM.generate raises it (GrammarError, a ValueError), leaving nothing queued
    llm = LLM(executor=EchoRunner(EngineConfig(device="cpu", max_model_len=512)), device="cpu", max_model_len=512)
    with pytest.raises(G.GrammarError, match="admits no output"):
        llm.generate([{"prompt_token_ids": [5]}] * 2, [SamplingParams(max_tokens=2), SamplingParams(
            max_tokens=2, structured_outputs=StructuredOutputsParams(grammar="root ::= root"))], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_aborting_a_request_that_waits_for_its_grammar(compiles):
    engine = _engine()
    held = StructuredOutputsParams(regex="held[a-z]")
    engine.add_request("held", None, SamplingParams(n=2, max_tokens=4, structured_outputs=held),
                       prompt_token_ids=[5, 6])
    engine.step()
    engine.abort_request("held")
    got = _run(engine)
    (d,) = got["held"]
    assert d.finished and d.error is None and [c.finish_reason for c in d.outputs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests()
    compiles.gate.set()      # the compile ends with no request left: the worker is told to release it
    key = G.grammar_key(held, engine.eos_token_ids)
    grammars = engine.executor.runner.grammars
    plain = iter(range(10**6))

    def released():          # plain requests carry the answer back and the release out
        engine.add_request(f"plain{next(plain)}", None, SamplingParams(max_tokens=2), prompt_token_ids=[5])
        _run(engine)
        return key in grammars._spare
    poll_until(released, 60, "the grammar to be released")
    assert key not in grammars._pinned and len(compiles) == 1
