"""The official ``openai`` Python client against ``folio serve`` running the default model on CPU.

Expectations are independent of the server: the golden greedy outputs and top-5 logits of
tests/data/smollm2_135m.json (Hugging Face transformers on the same GGUF), the offline engine
(``folio.LLM``) on the same prompts, the ZeroMQ door of the same server, and equivalences
(streamed vs whole, same seed twice).
"""

import asyncio
import math

import numpy as np
import openai   # in the test extra: missing, the install is broken (an error, not a skip)
import pytest
from support.serve_helpers import API_KEY
from support.numerics import forward_logit_atol

from folio.cmd_serve import spawn_server, stop_server
from folio.ipc.client import Client

MODEL = "smol"
FLAGS = ["--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(48 << 20), "--max-num-seqs", "16",
         "--api-key", API_KEY, "--served-model-name", MODEL, "smollm2-135m-instruct"]


@pytest.fixture(scope="module")
def served():
    proc, addr = spawn_server(FLAGS, startup_timeout=600)
    yield proc, addr, proc.http_url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[2] + "/v1", api_key=API_KEY, timeout=600, max_retries=0)


def case(golden, cid):
    return next(c for c in golden["greedy_cases"] if c["id"] == cid)


def ids_of(logprobs) -> list[int]:
    """Token ids from ``return_tokens_as_token_ids`` logprob tokens (``token_id:N``)."""
    return [int(t.split(":", 1)[1]) for t in logprobs.tokens]


def test_greedy_completion_equals_golden_offline_and_the_zmq_door(served, client, golden):
    from folio import LLM, SamplingParams
    a, b = case(golden, "a"), case(golden, "b")
    got = {}
    for c in (a, b):
        r = client.completions.create(model=MODEL, prompt=c["prompt_text"], max_tokens=8, temperature=0,
                                      logprobs=0, extra_body={"return_tokens_as_token_ids": True})
        choice = r.choices[0]
        got[c["id"]] = ids_of(choice.logprobs)
        assert got[c["id"]] == c["generated_ids_32_ignore_eos"][:8]
        assert r.usage.prompt_tokens == len(c["prompt_ids"]) and r.usage.completion_tokens == 8
        assert choice.finish_reason == "length"
    # the same prompt as token ids, through the other door of the same server
    with Client(served[1], timeout=300) as zc:
        out = zc.generate({"prompt_token_ids": a["prompt_ids"]}, {"max_tokens": 8, "temperature": 0.0})
    assert out.outputs[0].token_ids == got["a"]
    # the offline engine on the same prompts
    llm = LLM(device="cpu", max_model_len=512, kv_cache_memory=48 << 20)
    offline = llm.generate([a["prompt_text"], b["prompt_text"]], SamplingParams(max_tokens=8, temperature=0),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in offline] == [got["a"], got["b"]]
    r = client.completions.create(model=MODEL, prompt=a["prompt_text"], max_tokens=8, temperature=0)
    assert r.choices[0].text == offline[0].outputs[0].text


def test_chat_greedy_until_eos_equals_golden_and_streams_the_same(client, golden):
    e = case(golden, "e")
    want_text = e["generated_text_skip_special"]
    r = client.chat.completions.create(model=MODEL, messages=e["chat_messages"], temperature=0, max_tokens=40)
    assert r.choices[0].message.content == want_text
    assert r.choices[0].finish_reason == "stop"                   # the model's EOS, as in the golden run
    assert r.usage.completion_tokens == len(e["generated_ids_until_eos"])
    assert r.usage.prompt_tokens == len(e["prompt_ids"])
    # the first request of this prompt on the module's server (the tests before use other prompts;
    # the server's warm-up empties its prefix cache): nothing cached yet
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # streamed, with include_usage: the same text; a last chunk with usage and no choices
    chunks = list(client.chat.completions.create(model=MODEL, messages=e["chat_messages"], temperature=0,
                                                 max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # the second run found the prompt's full blocks in the prefix cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16 * (len(e["prompt_ids"]) // 16)
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want_text
    assert chunks[-2].choices[0].finish_reason == "stop"


def test_stop_string_and_stop_reason(client, golden):
    a = case(golden, "a")     # greedy: " Paris.\n\nThe answer is: 2018-..."
    r = client.completions.create(model=MODEL, prompt=a["prompt_text"], max_tokens=16, temperature=0, stop=["\n"])
    assert r.choices[0].text == " Paris." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == "\n"
    r = client.completions.create(model=MODEL, prompt=a["prompt_text"], max_tokens=16, temperature=0,
                                  stop=[" answer"], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == " Paris.\n\nThe answer"


def test_n2_and_seed_reproducibility(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2)
    one = client.completions.create(seed=1234, **kw)
    assert [c.index for c in one.choices] == [0, 1] and one.usage.completion_tokens == 16
    again = client.completions.create(seed=1234, **kw)
    assert [c.text for c in again.choices] == [c.text for c in one.choices]
    # a seed fixes the stream: three seeds giving three times the same 8-token sample would be a broken seed
    texts = {client.completions.create(seed=s, **{**kw, "n": 1}).choices[0].text for s in range(3)}
    assert len(texts) > 1
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=6,
                temperature=1.0, seed=7, n=2)
    c1, c2 = client.chat.completions.create(**chat), client.chat.completions.create(**chat)
    assert [c.message.content for c in c1.choices] == [c.message.content for c in c2.choices]
    assert len(c1.choices) == 2


def test_logprobs_match_the_golden_top5(client, golden):
    ref = golden["logits_capital"]
    a = case(golden, "a")
    assert "index 4" in ref["position"] and len(a["prompt_ids"]) == 5      # the first generated token's logits
    # golden log-probabilities of the first generated token: logit - logsumexp (transformers, float32).
    # Each logit is within two float32 schedules' rounding of the golden one (tests/support/numerics.py, as in
    # test_forward.test_golden_top5_logits); a logsumexp moves by at most the largest logit error, so
    # a log-probability is within twice that bound.
    c = golden["config"]
    atol = 2 * forward_logit_atol(c["num_hidden_layers"], max(c["hidden_size"], c["intermediate_size"]),
                                  np.asarray(ref["top5_logits"]), schedules=2)
    want = np.asarray(ref["top5_logits"]) - ref["logsumexp"]
    r = client.completions.create(model=MODEL, prompt=a["prompt_text"], max_tokens=2, temperature=0, logprobs=5,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    top = lp.top_logprobs[0]
    got = {int(t.split(":")[1]): v for t, v in top.items()}
    assert list(got)[:5] == ref["top5_ids"] or sorted(got, key=got.get, reverse=True)[:5] == ref["top5_ids"]
    np.testing.assert_allclose([got[t] for t in ref["top5_ids"]], want, atol=atol, rtol=0)
    # greedy took the best: its logprob and the top-1's are one float32 read from the same
    # log-softmax row, and JSON carries a float exactly (Python writes the shortest round trip)
    assert lp.token_logprobs[0] == got[ref["top5_ids"][0]]
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    # chat: logprobs=true + top_logprobs
    e = case(golden, "e")
    r = client.chat.completions.create(model=MODEL, messages=e["chat_messages"], temperature=0, max_tokens=4,
                                       logprobs=True, top_logprobs=3, extra_body={"cache_salt": "chat"})
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == entry.top_logprobs[0].logprob and entry.logprob <= 0  # the same float, as above
        assert entry.bytes == list(entry.token.encode())
        assert all(a.logprob >= b.logprob for a, b in zip(entry.top_logprobs, entry.top_logprobs[1:]))
        # probabilities of distinct tokens: at most 1, up to the float32 log-softmax's rounding (its
        # sum of V exponentials is within gamma_V = V u of the exact one, relative)
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1 + c["vocab_size"] * 2.0 ** -24
    # the chat's log-probabilities are the completions endpoint's for the same prompt ids: both run
    # alone, with a whole prefill (each its own cache_salt: no prefix-cache hit) and the same decode
    # steps, i.e. the same deterministic kernels on the same inputs
    comp = client.completions.create(model=MODEL, prompt=e["prompt_ids"], max_tokens=4, temperature=0, logprobs=3,
                                     extra_body={"cache_salt": "completion"})
    assert comp.choices[0].logprobs.tokens == [entry.token for entry in content]
    assert comp.choices[0].logprobs.token_logprobs == [entry.logprob for entry in content]


def test_async_client_streams_concurrently(served, golden):
    a, e = case(golden, "a"), case(golden, "e")

    async def main():
        client = openai.AsyncOpenAI(base_url=served[2] + "/v1", api_key=API_KEY, timeout=600, max_retries=0)
        async with client:
            async def stream_text():
                text, usage = "", None
                stream = await client.completions.create(model=MODEL, prompt=a["prompt_text"], max_tokens=6,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True})
                async for chunk in stream:
                    text += "".join(c.text for c in chunk.choices)
                    usage = chunk.usage or usage
                return text, usage

            streamed, whole, chat = await asyncio.gather(
                stream_text(),
                client.completions.create(model=MODEL, prompt=a["prompt_text"], max_tokens=6, temperature=0),
                client.chat.completions.create(model=MODEL, messages=e["chat_messages"], temperature=0,
                                               max_tokens=40))
            models = await client.models.list()
        return streamed, whole, chat, models

    (text, usage), whole, chat, models = asyncio.run(main())
    assert text == whole.choices[0].text and usage.completion_tokens == 6
    assert chat.choices[0].message.content == e["generated_text_skip_special"]
    assert [m.id for m in models.data] == [MODEL, "smollm2-135m-instruct"]


def test_openai_errors_raise_the_clients_exceptions(served, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="x", max_tokens=600)
    assert "512" in str(ei.value) and "601" in str(ei.value)     # both numbers: the sum and max_model_len
    bad = openai.OpenAI(base_url=served[2] + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
