"""Structured outputs (issue 33): constraints through SamplingParams, the wire, the worker's matchers
and the sampler's bitmask, on the default model (SmolLM2-135M-Instruct, CPU).

Expectations are independent of the code under test: ``jsonschema`` validates every JSON output,
``re.fullmatch`` every regex output, the choice list every choice, ``support.json_prefix`` (the
standard library's parser) an output cut by ``max_tokens``; the bitmask is checked against a
mask built bit by bit in Python; "batched equals alone" compares with the same request run alone.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from support.json_prefix import json_prefix_ok

from folio import LLM, SamplingParams
from folio.ipc import messages as M
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.sampling_params import StructuredOutputsParams
from folio.runtime.common.step import NewSequence, StepPlan, StepResult
from folio.runtime.common.grammar import GrammarError
from folio.runtime.worker.sampler import apply_token_bitmask

# the shortest valid output is ~12 tokens, so small max_tokens keep the suite quick
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON.", "Give me a JSON record of a cat.", "Output JSON:"]


# -- parameters -------------------------------------------------------------------------------------

def test_exactly_one_constraint_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one.*json, regex"):
        StructuredOutputsParams(json=SCHEMA, regex="a+")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(ValueError, match="not a JSON schema"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="unknown structured_outputs"):
        SamplingParams(structured_outputs={"jsonn": {}})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


def test_round_trip_through_dict_and_the_wire():
    sp = SamplingParams(temperature=0.5, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    d = sp.to_dict()
    assert d["structured_outputs"] == {"json": SCHEMA}
    assert SamplingParams.from_dict(d) == sp
    plan = StepPlan(step_id=1, input_ids=np.zeros(1, np.int64), positions=np.zeros(1, np.int64),
                    slot_mapping=np.zeros(1, np.int64), query_start_loc=np.array([0, 1], np.int32),
                    seq_lens=np.ones(1, np.int32), block_tables=np.zeros((1, 1), np.int32),
                    seq_ids=np.zeros(1, np.int64), logits_indices=np.zeros(1, np.int64),
                    sample_seq_ids=np.zeros(1, np.int64),
                    new_seqs=[NewSequence(0, [1, 2], [5], d, None, [2])])
    got = M.plan_from_fields(M.decode([bytes(f) for f in M.encode_plan(plan)])[1])
    assert SamplingParams.from_dict(got.new_seqs[0].sampling) == sp
    # the grammar's own fields: a compile (the constraint, once), its key on the sequence, a
    # release, and the worker's answer
    key = "ab" * 32
    plan.new_seqs = [NewSequence(0, [1, 2], [5], {**d, "structured_outputs": None}, None, [2], grammar_key=key)]
    plan.grammar_compiles = [{"key": key, "structured_outputs": d["structured_outputs"], "eos_token_ids": [2]}]
    plan.grammar_releases = ["cd" * 32]
    got = M.plan_from_fields(M.decode([bytes(f) for f in M.encode_plan(plan)])[1])
    assert got.new_seqs[0].grammar_key == key and got.grammar_compiles == plan.grammar_compiles
    assert got.grammar_releases == plan.grammar_releases
    res = StepResult(1, np.zeros(1, np.int64), grammar_results=[{"key": key, "error": None},
                                                                {"key": "cd" * 32, "error": "bad"}])
    assert M.result_from_fields(M.decode([bytes(f) for f in M.encode_result(res)])[1]).grammar_results == \
        res.grammar_results


# -- the sampler's mask -----------------------------------------------------------------------------

def test_apply_token_bitmask_matches_a_bit_by_bit_mask():
    rng = np.random.default_rng(0)
    R, V = 3, 70  # V not a multiple of 32: the last word is partly padding
    logits = rng.standard_normal((R, V)).astype(np.float32)
    bits = rng.integers(0, 2, (R, V)).astype(bool)
    words = np.zeros((R, (V + 31) // 32), dtype=np.uint32)
    for r in range(R):
        for t in range(V):
            if bits[r, t]:
                words[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    got = apply_token_bitmask(logits, words.view(np.int32))
    expect = np.where(bits, logits, -np.inf)
    assert np.array_equal(got, expect)


# -- the engine -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner():
    from folio.runtime.worker.model_runner import ModelRunner
    r = ModelRunner(EngineConfig(device="cpu", num_kv_blocks_override=128))
    yield r
    r.shutdown()


@pytest.fixture(scope="module")
def llm(runner):
    return LLM(executor=runner, device="cpu")


def _so(**kw):
    return StructuredOutputsParams(**kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm, temperature):
    sp = SamplingParams(temperature=temperature, seed=3, max_tokens=48, structured_outputs=_so(json=SCHEMA))
    for out in llm.generate(PROMPTS, sp, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text  # EOS only where the grammar accepts
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_grammar_and_json_object(llm):
    outs = llm.generate(["Phone number:"] * 2, [
        SamplingParams(temperature=1.0, seed=1, max_tokens=16, structured_outputs=_so(regex=r"\d{3}-\d{4}")),
        SamplingParams(temperature=1.0, seed=2, max_tokens=16, structured_outputs=_so(regex=r"(red|blue)[0-9]"))],
        use_tqdm=False)
    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].outputs[0].text)
    assert re.fullmatch(r"(red|blue)[0-9]", outs[1].outputs[0].text)
    out = llm.generate("Is water wet?", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                       structured_outputs=_so(choice=["yes", "no", "unsure"])),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(c.text in ("yes", "no", "unsure") for c in out.outputs)
    g = 'root ::= "The answer is " digit digit "."\ndigit ::= [0-9]'
    out = llm.generate("Q: 6*7?", SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=_so(grammar=g)),
                       use_tqdm=False)[0]
    assert re.fullmatch(r"The answer is [0-9]{2}\.", out.outputs[0].text)
    out = llm.generate("JSON:", SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=_so(json_object=True)),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    if c.finish_reason == "stop":  # EOS only where the grammar accepts: a whole object
        assert isinstance(json.loads(c.text), dict), c.text
    else:  # the default model writes on past 200 tokens here: what it wrote must begin an object
        assert c.finish_reason == "length" and len(c.token_ids) == 40, c
        assert json_prefix_ok(c.text, top="{"), c.text


def test_json_prefix_check_accepts_every_prefix_and_rejects_broken_json():
    # the check the cut json_object output is held to (support/json_prefix.py), on its own
    for doc in ['{"a": [1, -2.5e+3, true, false, null, "x\\u00e9\\n"], "b": {"c": {}}, "d": []}',
                '[{"k": "v"}, 0.5, "\\\\"]']:
        json.loads(doc)
        assert all(json_prefix_ok(doc[:i]) for i in range(len(doc) + 1))
    for bad in ['{"a" 1', '{]', '{"a": tru,', '[1,,', '{"a": 1}}', '"\\q', '{1: 2}', '[01', 'nul1']:
        assert not json_prefix_ok(bad), bad
    assert not json_prefix_ok("[1]", top="{")


def test_cut_by_max_tokens_is_length(llm):
    out = llm.generate("JSON:", SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=_so(json=SCHEMA)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    assert json_prefix_ok(out.text, top="{"), out.text


def test_unconstrained_rows_batched_with_constrained_equal_alone(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=1.0, seed=9, max_tokens=12)]
    alone = [llm.generate("Tell me a story.", sp, use_tqdm=False)[0].outputs[0].token_ids for sp in free]
    con = SamplingParams(temperature=1.0, seed=4, max_tokens=24, structured_outputs=_so(json=SCHEMA))
    outs = llm.generate(["Tell me a story.", "JSON:", "Tell me a story.", "Person:"],
                        [free[0], con, free[1], con], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone[0]
    assert outs[2].outputs[0].token_ids == alone[1]


class _FewBlocks:
    """The module's worker seen as a pool of ``num_blocks`` blocks (its first ones)."""

    def __init__(self, runner, num_blocks):
        self._runner, self.num_blocks = runner, num_blocks
        self.model_config, self.model_dir = runner.model_config, runner.model_dir

    def execute(self, plan):
        return self._runner.execute(plan)

    def shutdown(self):
        pass


def test_preempted_constrained_sequences_replay_their_matchers(runner):
    # 5 blocks (16 tokens each) for 4 samples that each need 3: preemption by recompute
    small = LLM(executor=_FewBlocks(runner, 5), device="cpu")
    sp = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=40, structured_outputs=_so(json=SCHEMA))
    out = small.generate("Describe a person as JSON.", sp, use_tqdm=False)[0]
    assert small.llm_engine.scheduler.num_preemptions > 0
    for c in out.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    # the same samples without preemption (seeded per sample): the same tokens
    ref = LLM(executor=runner, device="cpu").generate("Describe a person as JSON.", sp, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]


@pytest.mark.parametrize("so, needle", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "invalid json"),
    (dict(regex="a[b"), "invalid regex"),
    (dict(grammar="root ::= ( unclosed"), "grammar"),
])
def test_bad_constraints_fail_before_they_run(llm, so, needle):
    # the worker's compile refuses it: the request ends with the error before any step of its
    # own; LLM.generate raises it
    with pytest.raises(GrammarError, match=needle) as e:
        llm.generate("x", SamplingParams(structured_outputs=_so(**so)), use_tqdm=False)
    assert e.value.param == "structured_outputs"
    assert not llm.llm_engine.has_unfinished_requests()
    # known bad now: refused by add_request at once
    with pytest.raises(GrammarError, match=needle):
        llm.llm_engine.add_request("bad", "x", SamplingParams(structured_outputs=_so(**so)))
    assert "bad" not in llm.llm_engine.scheduler.requests
    # others are unaffected
    out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_input_processor_hands_tools_to_the_chat_template(default_model_dir):
    from folio.model.tokenizer import Tokenizer
    from folio.runtime.inputs.input_processor import InputProcessor
    tok = Tokenizer.from_pretrained(default_model_dir)
    tok.chat_template = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>{% endif %}"
                         "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    tok.__dict__.pop("_compiled_template", None)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}},
             {"type": "function", "function": {"name": "get_time"}}]
    ip = InputProcessor(tok, 512)
    msgs = [{"role": "user", "content": "hi"}]
    assert ip.render_chat(msgs, tools=tools) == "<tools>get_weather get_time </tools>user: hi\n"
    assert ip.render_chat(msgs) == "user: hi\n"


def test_a_grammar_that_allows_only_eos_wins_over_min_tokens():
    from folio.runtime.worker.sampler import SamplingState, sample
    V, eos = 64, 7
    words = np.zeros((2, 2), dtype=np.uint32)
    words[0, eos // 32] = np.uint32(1) << np.uint32(eos % 32)            # row 0: EOS only
    words[1, 0] = (np.uint32(1) << np.uint32(eos)) | np.uint32(1 << 3)   # row 1: EOS or token 3
    states = [SamplingState(i, SamplingParams(temperature=0.0, min_tokens=5), [1], [], None, [eos]) for i in range(2)]
    logits = np.zeros((2, V), dtype=np.float32)
    logits[:, eos] = 5.0  # EOS is the argmax everywhere
    got = sample(logits, states, np, bitmask=words.view(np.int32)).token_ids
    assert got.tolist() == [eos, 3]  # row 0: nothing else allowed; row 1: min_tokens masks EOS


def test_the_batched_mask_equals_each_matcher_alone(default_model_dir):
    from folio.model.tokenizer import Tokenizer
    from folio.runtime.common.grammar import fill_bitmask
    from folio.runtime.worker.sampler import SamplingState
    from folio.runtime.common.grammar import grammar_key
    from folio.runtime.worker.grammar_matchers import GrammarMatchers, fill_batch_bitmask
    from support.serve_helpers import poll_until
    tok = Tokenizer.from_pretrained(default_model_dir)
    V = tok.vocab_size
    valid = tok.hf.encode('{"name": "Ann", "age": 31}', add_special_tokens=False).ids
    so = _so(json=SCHEMA)
    gm = GrammarMatchers(tok.hf.to_str)
    key = grammar_key(so, tok.eos_token_ids)
    gm.prepare(key, so.to_dict(), tok.eos_token_ids)
    poll_until(lambda: gm.poll(0.05), 60, "the compile")
    states = [SamplingState(i, SamplingParams(), [1], valid[:i], None, tok.eos_token_ids) for i in range(len(valid))]
    states.insert(2, SamplingState(99, SamplingParams(), [1], [], None, tok.eos_token_ids))  # unconstrained
    for i, st in enumerate(states):
        if i != 2:
            gm.attach(st, key)
    got = fill_batch_bitmask(states, V)
    assert (got[2] == -1).all()
    for i, st in enumerate(states):
        if st.matcher is None:
            continue
        row = np.zeros(got.shape[1], dtype=np.int32)
        fill_bitmask(st.matcher.deep_copy(), row)
        assert np.array_equal(got[i], row), i
        if len(st.output_token_ids) < len(valid):  # the valid instance's next token is allowed
            t = valid[len(st.output_token_ids)]
            assert (int(row[t >> 5]) >> (t & 31)) & 1
