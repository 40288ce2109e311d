"""What a long prompt does to the streams running beside it, with and without ``--max-step-ms``.

The default model on the CPU, in this process (``LLMEngine`` over ``ModelRunner``, overlap on, the
kernels warmed up first): ``--streams`` requests decode (greedy, ignore_eos); once each has 8
tokens, one prompt of ``--prompt-tokens`` tokens arrives (one output token). For each
``--max-step-ms`` value (``0``: no bound, chunks of ``--max-num-batched-tokens``), printed:

  ITL p50 / max:  the streams' inter-token latencies (gaps between a stream's deltas, in ms) from
                  the long prompt's arrival to its first token;
  steps:          engine steps in that window;
  TTFT:           the long prompt's time to its first token (s).

    python perf/step_time_bound.py [--prompt-tokens 6000] [--streams 2] [--max-step-ms 0 100 200 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "perf"))
from engine_overhead import cpu_model  # noqa: E402


def one_run(runner, config_kwargs, max_step_ms, streams, prompt_tokens, long_ids):
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.common.sampling_params import SamplingParams
    from folio.runtime.scheduler.engine import LLMEngine
    engine = LLMEngine(EngineConfig(**config_kwargs, max_step_ms=max_step_ms or None), executor=runner)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4000)
    for i in range(streams):
        engine.add_request(f"s{i}", None, greedy, prompt_token_ids=long_ids[i * 7:i * 7 + 12])
    times: dict[str, list[float]] = {f"s{i}": [] for i in range(streams)}
    arrived = first = None
    steps = 0
    while True:
        deltas = engine.step()
        now = time.perf_counter()
        if arrived is not None and first is None:
            steps += 1
        for d in deltas:
            if d.request_id == "long":
                first = now
            elif d.outputs and d.outputs[0].token_ids:
                times[d.request_id].append(now)
        if arrived is None and all(len(t) >= 8 for t in times.values()):
            engine.add_request("long", None, SamplingParams(temperature=0.0, max_tokens=1),
                               prompt_token_ids=long_ids[:prompt_tokens])
            arrived = time.perf_counter()
        if first is not None:
            break
    engine.abort_request(list(times))
    while engine.has_unfinished_requests():
        engine.step()
    gaps = [1e3 * (b - a) for t in times.values() for a, b in zip(t, t[1:]) if b > arrived]
    return statistics.median(gaps), max(gaps), steps, first - arrived


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=6000)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--max-step-ms", type=float, nargs="+", default=[0, 100, 200, 400])
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    a = p.parse_args(argv)

    from folio.model.registry import resolve_model
    from folio.model.tokenizer import Tokenizer
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    from folio.runtime.worker.model_runner import ModelRunner
    kw = dict(device="cpu", max_model_len=8192, max_num_seqs=8, max_num_batched_tokens=a.max_num_batched_tokens)
    runner = ModelRunner(EngineConfig(**kw))
    LLMEngine(EngineConfig(**kw), executor=runner).warm_up()
    tok = Tokenizer.from_pretrained(resolve_model(EngineConfig().model))
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    ids = tok.encode(text)
    long_ids = (ids * (a.prompt_tokens // max(1, len(ids)) + 2))[:a.prompt_tokens + 64]
    print(f"# {cpu_model()}, {os.cpu_count()} CPUs; default model, {a.streams} streams decoding, one prompt of "
          f"{a.prompt_tokens} tokens arrives; max_num_batched_tokens {a.max_num_batched_tokens}")
    print(f"{'max_step_ms':>12} {'ITL p50 ms':>11} {'ITL max ms':>11} {'steps':>6} {'TTFT s':>7}")
    for ms in a.max_step_ms:
        p50, worst, steps, ttft = one_run(runner, kw, ms, a.streams, a.prompt_tokens, long_ids)
        print(f"{(ms or 'off'):>12} {p50:11.1f} {worst:11.1f} {steps:6d} {ttft:7.2f}", flush=True)
    runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
