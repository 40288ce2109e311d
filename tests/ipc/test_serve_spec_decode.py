"""``folio serve --speculative-config`` with the default model in its worker process: over HTTP a
streamed answer (several tokens per step reach the client in one chunk) has the text and token
logprobs of the offline engine without speculation, and ``/metrics`` counts the drafts."""

from __future__ import annotations

import json

import httpx
import pytest

from folio.cmd_serve import spawn_server, stop_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
PROMPT = ("Repeat this sentence exactly: The committee will meet on Tuesday at the north entrance of the "
          "library, and every member should bring the report.")


def sse_events(text: str) -> list:
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.slow
def test_streamed_speculative_answer_equals_offline_and_metrics_count_drafts():
    from folio import LLM, SamplingParams
    flags = ["--device", "cpu", "--max-model-len", "512", "--kv-cache-memory", str(32 << 20),
             "--speculative-config", json.dumps(SPEC)]
    proc, _ = spawn_server(flags, startup_timeout=600)
    try:
        body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 40, "temperature": 0, "logprobs": True, "top_logprobs": 2, "stream": True}
        r = httpx.post(proc.http_url + "/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200
        chunks = [e["choices"][0] for e in sse_events(r.text) if e["choices"]]
        text = "".join(c["delta"].get("content") or "" for c in chunks)
        streamed = [x for c in chunks if c.get("logprobs") for x in c["logprobs"]["content"]]
        assert any(c.get("logprobs") and len(c["logprobs"]["content"]) > 1 for c in chunks), \
            "no step emitted several tokens"
        metrics = httpx.get(proc.http_url + "/metrics", timeout=60).text
    finally:
        assert stop_server(proc) == 0
    drafts = [ln for ln in metrics.splitlines() if ln.startswith("folio:spec_decode_num_accepted_tokens_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    llm = LLM(device="cpu", max_model_len=512, kv_cache_memory=32 << 20)
    out = llm.chat([{"role": "user", "content": PROMPT}], SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
                   use_tqdm=False)[0].outputs[0]
    assert text == out.text
    tok = llm.get_tokenizer()
    assert [x["token"] for x in streamed] == [tok.decode([t], skip_special_tokens=False) for t in out.token_ids]
