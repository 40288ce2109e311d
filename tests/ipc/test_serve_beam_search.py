"""Beam search and prompt logprobs through `folio serve` (real processes): the ZeroMQ clients and
the HTTP process's ``use_beam_search`` extension.

The worker is ``tests/support/ipc_fake_runner.EchoRunner``: its made-up logprobs (``echo_logprobs``, a
function of the last token) make the expected beams computable by the independent search of
tests/support/beam_reference.py; the real model's numbers are tested offline (tests/runtime/scheduler/test_beam_search.py,
tests/runtime/scheduler/test_prompt_logprobs.py), so this file checks the serving path: messages, routing, the final
one-message result, errors, and the blocks coming back.
"""

import asyncio

import numpy as np
import pytest

from support.beam_reference import reference_beam_search
from folio import AsyncClient, BeamSearchParams, Client, SamplingParams
from folio.ipc.client import ServerError
from support.ipc_fake_runner import echo_logprobs
from support.serve_helpers import idle_metrics

VOCAB = 49152


def echo_lp(history):
    lp = np.full(VOCAB, -np.inf)
    ids, lps = echo_logprobs([history[-1]], 16)
    lp[ids[0, 1:]] = lps[0, 1:]
    return lp


@pytest.fixture(scope="module")
def server(echo_http):
    return echo_http[1]


def expected(prompt_ids, params):
    seqs, _ = reference_beam_search(lambda prefixes: [echo_lp(x) for x in prefixes], prompt_ids, params, [])
    return [(ids, cum) for ids, cum, _ in seqs]


def test_client_beam_search_matches_reference_and_frees_blocks(server):
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True, length_penalty=0.5)
    prompts = [{"prompt_token_ids": [100, 204]}, {"prompt_token_ids": [301, 402, 503, 604, 7]}]
    with Client(server, timeout=60) as c:
        free = idle_metrics(c)["num_free_blocks"]
        outs = c.beam_search(prompts, params)
        for p, out in zip(prompts, outs):
            got = [(s.token_ids, s.cum_logprob) for s in out.sequences]
            assert got == expected(p["prompt_token_ids"], params)
            assert all(s.finish_reason == "length" for s in out.sequences)
        # the text form and a dict of parameters are accepted too
        one = c.beam_search("Hello there", params.to_dict())
        assert len(one) == 1 and len(one[0].sequences) == 3
        with pytest.raises(ServerError, match="KV blocks"):   # 10 beams x 63 blocks > 512
            c.beam_search("Hello", {"beam_width": 10, "max_tokens": 1000})
        with pytest.raises(ValueError, match="beam_width"):
            c.beam_search("Hello", {"beam_width": 0, "max_tokens": 2})     # refused before sending
        assert idle_metrics(c)["num_free_blocks"] == free


def test_async_client_beam_search_and_prompt_logprobs(server):
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    p = [900, 17, 42]

    async def main():
        async with AsyncClient(server, timeout=60) as c:
            beams = await c.beam_search([{"prompt_token_ids": p}], params)
            out = await c.generate(prompt_token_ids=p, sampling_params=SamplingParams(
                max_tokens=2, prompt_logprobs=2, temperature=0.0))
            return beams, out

    beams, out = asyncio.run(main())
    assert [(s.token_ids, s.cum_logprob) for s in beams[0].sequences] == expected(p, params)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(p)
    for i in range(1, len(p)):
        # the echo's made-up prompt logprobs: the prompt token at -3.0 rank 7, then the top 2
        assert plp[i][p[i]].logprob == -3.0 and plp[i][p[i]].rank == 7
        assert len(plp[i]) == 3


def test_http_use_beam_search(echo_http, default_model_dir):
    import json

    import httpx
    from support.serve_helpers import API_KEY
    from folio.model.tokenizer import Tokenizer
    tok = Tokenizer.from_pretrained(default_model_dir)
    _, addr, url = echo_http
    p = [700, 31, 8]
    params = BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True)
    want = expected(p, params)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as h:
        body = {"model": "echo", "prompt": p, "max_tokens": 4, "ignore_eos": True, "use_beam_search": True, "n": 3}
        r = h.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        texts = [c["text"] for c in out["choices"]]
        assert texts == [tok.decode(ids) for ids, _ in want]   # the best first
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        assert out["usage"]["completion_tokens"] == sum(len(ids) for ids, _ in want)
        # folio's beam_width field sets the width instead of n; the stream carries the same choices
        r = h.post("/v1/completions", json={**body, "n": 1, "beam_width": 3, "stream": True})
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e.startswith("data: {")]
        streamed = {}
        for e in events:
            for c in json.loads(e[6:])["choices"]:
                streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
        assert [streamed[k] for k in range(3)] == texts
        r = h.post("/v1/chat/completions", json={"model": "echo", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 3, "use_beam_search": True, "n": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        r = h.post("/v1/completions", json={**body, "stop": ["x"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
        r = h.post("/v1/completions", json={**body, "n": 11})
        assert r.status_code == 400 and "beam_width" in r.json()["error"]["message"]
    with Client(addr, timeout=60) as c:
        m = idle_metrics(c)
        assert m["num_free_blocks"] == m["num_total_blocks"]
