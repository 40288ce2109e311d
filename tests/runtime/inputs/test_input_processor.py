"""The input processor (runtime/inputs/input_processor.py) every door shares, and the small API
items of issue 31 that sit on it: LLMEngine.add_request's dict prompts, decoded tokens in
logprobs, the bounds on ``stop``, the REPL's default top_p, ``make run PORT=``.

The engine tests run the real engine, scheduler and tokenizer in this process with
``tests/support/ipc_fake_runner.EchoRunner`` as the worker (next id = last id + 1, made-up logprobs), so
every expected value is known independently of folio's model code.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.ipc_fake_runner import EchoRunner, echo_logprobs

from folio import SamplingParams
from folio.runtime.common.config import EngineConfig
from folio.runtime.common.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from folio.runtime.inputs.input_processor import InputError, InputProcessor, parse_prompt

from support import ROOT


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from folio.model.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(default_model_dir)


class CountingTokenizer:
    """The real tokenizer, counting ``encode`` calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return self.tok.encode(text, add_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_max_chars_per_token_is_the_longest_vocabulary_string_and_bounds_real_texts(tokenizer, default_model_dir):
    spec = json.loads((Path(default_model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    longest = max([len(t) for t in spec["model"]["vocab"]] + [len(t["content"]) for t in spec["added_tokens"]])
    n = InputProcessor(tokenizer, 4096).max_chars_per_token
    assert n == longest
    # the bound it stands for: no text has more than n characters per token
    texts = ["-" * 500, " " * 999, "\n" + " " * 300, "#" * 1000, "é" * 300 + "日本語" * 50,
             "<|im_start|>" * 20, "The quick brown fox jumps over the lazy dog. " * 30]
    for text in texts:
        assert len(text) <= n * len(tokenizer.encode(text)), text[:20]


def test_a_tokenizer_that_drops_characters_gets_no_bound(tokenizer):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers
    hf = HF(models.BPE({"a": 0, "b": 1, "[UNK]": 2}, [], unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()     # whitespace vanishes: no per-token bound
    fake = type("T", (), {"hf": hf, "vocab_size": 3})()
    assert InputProcessor(fake, 16).max_chars_per_token is None


def test_too_long_text_is_refused_before_tokenizing(tokenizer):
    counting = CountingTokenizer(tokenizer)
    proc = InputProcessor(counting, 1024)
    n = proc.max_chars_per_token
    with pytest.raises(InputError, match="at least") as e:
        proc.tokenize("a" * (n * 1024 + 1), max_tokens=None)     # >= 1025 tokens, whatever they are
    assert e.value.param == "prompt" and counting.calls == 0
    with pytest.raises(InputError, match=r"max_tokens \(10\)") as e:
        proc.tokenize("a" * (n * 1020 + 1), max_tokens=10)       # >= 1021 + 10 > 1024
    assert e.value.param == "max_tokens" and counting.calls == 0
    # not provably too long: tokenized, then measured
    with pytest.raises(InputError, match="max_model_len") as e:
        proc.tokenize("hello " * 1100, max_tokens=None)
    assert counting.calls == 1 and e.value.param == "prompt"
    assert proc.tokenize("hello", max_tokens=16) == tokenizer.encode("hello")


def test_length_errors_name_the_field_in_the_right_number(tokenizer):
    proc = InputProcessor(tokenizer, 4096)
    with pytest.raises(InputError) as e:
        proc.check_length(1, 1_000_000)
    assert e.value.param == "max_tokens"
    assert str(e.value) == "prompt (1 token) + max_tokens (1000000) = 1000001 exceeds max_model_len (4096)"
    with pytest.raises(InputError, match=r"prompt \(2 tokens\)"):
        proc.check_length(2, 4095)
    with pytest.raises(InputError) as e:                  # the prompt alone is over: the prompt's fault
        proc.check_length(5000, 16, param="messages", max_tokens_param="max_completion_tokens")
    assert e.value.param == "messages" and "max_completion_tokens (16)" in str(e.value)
    assert proc.check_length(10, None) == 4086 and proc.check_length(10, 0) == 0


def test_prompt_forms_and_chat(tokenizer):
    proc = InputProcessor(tokenizer, 4096)
    assert parse_prompt("hi") == ("hi", None, None)
    assert parse_prompt({"prompt_token_ids": [1, 2], "cache_salt": "s"}) == (None, [1, 2], "s")
    assert parse_prompt(None, [3]) == (None, [3], None)
    for bad, param in [({"prompt_ids": [1]}, "prompt"), (3, "prompt"), (None, "prompt"),
                       ({"prompt": "a", "cache_salt": 5}, "cache_salt")]:
        with pytest.raises(InputError) as e:
            parse_prompt(bad)
        assert e.value.param == param
    p = proc.process({"prompt": "Hello there", "cache_salt": "t"}, 8)
    assert (p.prompt, p.prompt_token_ids, p.cache_salt, p.max_tokens) == \
        ("Hello there", tokenizer.encode("Hello there"), "t", 8)
    msgs = [{"role": "user", "content": "Hi"}]
    c = proc.process(None, None, messages=msgs)
    assert c.prompt == tokenizer.apply_chat_template(msgs) and c.prompt_token_ids == tokenizer.encode(c.prompt)
    assert c.max_tokens == 4096 - len(c.prompt_token_ids)
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": "\ud800"}]):
        with pytest.raises(InputError) as e:
            proc.process(None, None, messages=bad)
        assert e.value.param == "messages"
    for ids, needle in [([], "empty"), ([1, 10 ** 6], "vocabulary"), (["1"], "integers")]:
        with pytest.raises(InputError, match=needle):
            proc.process({"prompt_token_ids": ids}, 4)


# -- the engine's doors -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine():
    from folio.runtime.scheduler.engine import LLMEngine
    config = EngineConfig(device="cpu", max_model_len=512, async_scheduling=False)
    return LLMEngine(config, executor=EchoRunner(config))


def _run(engine) -> dict:
    deltas: dict = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def test_add_request_takes_the_dict_prompts_llm_generate_takes(engine, tokenizer):
    sp = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    engine.add_request("ids", {"prompt_token_ids": [5, 6]}, sp)
    engine.add_request("text", {"prompt": "Hello", "cache_salt": "tenant"}, sp)
    engine.add_request("plain", "Hello", sp)
    out = _run(engine)
    assert [t for d in out["ids"] for c in d.outputs for t in c.token_ids] == [7, 8, 9]
    last = tokenizer.encode("Hello")[-1]
    assert out["text"][0].prompt_token_ids == tokenizer.encode("Hello")
    assert [t for d in out["text"] for c in d.outputs for t in c.token_ids] == [last + 1, last + 2, last + 3]
    with pytest.raises(ValueError, match="unknown prompt keys"):
        engine.add_request("bad", {"prompt_ids": [1]}, sp)
    with pytest.raises(ValueError, match="prompt or prompt_token_ids"):
        engine.add_request("bad", {"cache_salt": "x"}, sp)
    assert not engine.has_unfinished_requests()


def test_logprobs_carry_the_decoded_token(engine, tokenizer):
    prompt = [100, 200, 300]
    engine.add_request("lp", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, logprobs=2, prompt_logprobs=2))
    deltas = _run(engine)["lp"]
    prompt_lps = next(d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None)
    assert prompt_lps[0] is None and len(prompt_lps) == 3
    for pos in (1, 2):
        top_ids, _ = echo_logprobs([prompt[pos - 1]], 2)      # EchoRunner's made-up candidates
        assert set(prompt_lps[pos]) == {prompt[pos], *top_ids[0, 1:].tolist()}
        for t, lp in prompt_lps[pos].items():
            assert lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
    sample_lps = [e for d in deltas for c in d.outputs for e in (c.logprobs or [])]
    assert len(sample_lps) == 2
    for entry in sample_lps:
        for t, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)


# -- small API items ----------------------------------------------------------------------------------

def test_stop_is_bounded_in_count_and_length():
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["y" * (MAX_STOP_CHARS // 2)] * 2)
    with pytest.raises(ValueError, match=rf"^stop takes at most {MAX_STOP_STRINGS} strings, got {MAX_STOP_STRINGS + 1}"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=rf"^stop strings take at most {MAX_STOP_CHARS} characters"):
        SamplingParams(stop=["y" * MAX_STOP_CHARS, "z"])


def test_repl_samples_with_the_http_apis_default_top_p():
    from folio.repl import DEFAULT_PARAMS
    assert DEFAULT_PARAMS["top_p"] == SamplingParams().top_p == 1.0


def test_make_run_takes_the_http_port(monkeypatch):
    # a make of its own: under `make test` the parent's MAKEFLAGS / MAKELEVEL would add directory lines
    env = {k: v for k, v in os.environ.items() if k not in ("PORT", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}

    def demo_line(*args):
        make = subprocess.run(["make", "--no-print-directory", "-n", "run", *args], cwd=ROOT, capture_output=True,
                              text=True, env=env)
        assert make.returncode == 0, make.stderr
        return [line.rstrip() for line in make.stdout.splitlines() if "folio.demo" in line][-1]

    assert demo_line("PORT=8123").endswith("folio.demo --port 8123")
    assert demo_line().endswith("folio.demo")
    import folio.demo as demo
    seen = {}

    def spawn_server(flags, **kw):
        seen["flags"] = flags
        raise SystemExit(7)           # the demo stops here: nothing is started

    monkeypatch.setattr(demo, "_port_free", lambda port: True)
    monkeypatch.setattr("folio.cmd_serve.spawn_server", spawn_server)
    monkeypatch.setenv("FOLIO_PORT", "8124")
    with pytest.raises(SystemExit):
        demo.main([])
    assert seen["flags"][seen["flags"].index("--port") + 1] == "8124"
