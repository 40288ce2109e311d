"""The cost of the process boundary (issue 4, section 7).

Runs the engine on a tiny random-weights Llama (2 layers, hidden 64, the default model's
tokenizer and vocabulary) so the forward pass is small, with N = 1, 64, 256 running sequences in
decode, twice: with the in-process ``ModelRunner`` and with ``ZmqExecutor`` (worker process).
For each it reports engine steps per second and the per-step overhead, i.e. the wall time of
``engine.step()`` minus the worker's forward + sampling time (as the worker measured it):

  in-process overhead = scheduling, plan building, result processing, detokenizing;
  zmq overhead        = the same plus encoding, the two socket hops and decoding;
  process hop         = the difference.

On a machine shared with other load the engine-level difference is dominated by wake-up latency
of the two processes, so the script first measures the hop alone: ``ZmqExecutor`` round trips of
decode-shaped plans (N sequences, 16-entry block tables) to a worker whose runner only echoes
(``tests/support/ipc_fake_runner.EchoRunner``): encode + send + worker decode + reply + decode.

``--codec-only``: the wire codec alone, in this process (no sockets): microseconds to encode and to
decode (frames -> ``StepPlan`` / ``StepResult``) a decode plan of N sequences, a plan that starts N
sequences (200-token prompts, a full ``SamplingParams`` dict each), a step result (with and without
top-5 logprobs) and a ``generate`` request; the median of ``--reps`` rounds.

    python perf/ipc_overhead.py [--seqs 1 64 256] [--steps 50] [--device cpu] [--hop-only | --codec-only]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def tiny_model_dir(device_vocab_from: str = "smollm2-135m-instruct") -> str:
    """A folder with a tiny Llama config.json plus the default model's tokenizer files."""
    from folio.model.registry import resolve_model
    src = resolve_model(device_vocab_from)
    d = tempfile.mkdtemp(prefix="folio-tiny-")
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(os.path.join(src, name), d)
    return d


def decode_plan(step_id: int, n: int, max_blocks: int = 16):
    import numpy as np
    from folio.runtime.common.step import StepPlan
    return StepPlan(step_id=step_id, input_ids=np.arange(n, dtype=np.int64), positions=np.full(n, 100, np.int64),
                    slot_mapping=np.arange(n, dtype=np.int64), query_start_loc=np.arange(n + 1, dtype=np.int32),
                    seq_lens=np.full(n, 101, np.int32),
                    block_tables=np.arange(n * max_blocks, dtype=np.int32).reshape(n, max_blocks),
                    seq_ids=np.arange(n, dtype=np.int64), logits_indices=np.arange(n, dtype=np.int64),
                    sample_seq_ids=np.arange(n, dtype=np.int64))


def measure_hop(seqs: list[int], steps: int) -> dict:
    """Median / p90 microseconds of one ZmqExecutor round trip with an echoing worker."""
    from folio.ipc.zmq_executor import ZmqExecutor
    from folio.runtime.common.config import EngineConfig
    tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
    env = {**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ex = ZmqExecutor(EngineConfig(), runner="support.ipc_fake_runner:EchoRunner", env=env)
    out = {}
    try:
        for n in seqs:
            ts = []
            for i in range(steps + 10):
                plan = decode_plan(i, n)
                t0 = time.perf_counter()
                ex.execute(plan)
                ts.append(time.perf_counter() - t0)
            ts = sorted(ts[10:])
            out[n] = (1e6 * ts[len(ts) // 2], 1e6 * ts[int(len(ts) * 0.9)])
            print(f"hop only   seqs={n:4d}  {out[n][0]:8.0f} us median round trip, {out[n][1]:8.0f} us p90",
                  flush=True)
    finally:
        ex.shutdown()
    return out


def measure_codec(seqs: list[int], reps: int) -> dict:
    """Median microseconds of each encode and decode (module docstring), by case and N."""
    import numpy as np
    from folio.ipc import messages as M
    from folio.runtime.common.sampling_params import SamplingParams
    from folio.runtime.common.step import NewSequence, StepResult

    def timed(fn):
        for _ in range(min(100, reps)):       # warm-up: caches, allocator, branch predictors
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(ts)

    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64, stop=["\n\n"]).to_dict()
    out = {}
    for n in seqs:
        plan = decode_plan(7, n)
        start = decode_plan(8, n)
        start.new_seqs = [NewSequence(i, list(range(100, 300)), [], sampling, None, [2]) for i in range(n)]
        result = StepResult(7, np.arange(n, dtype=np.int64), forward_time=0.01, sample_time=0.001)
        with_lp = StepResult(7, np.arange(n, dtype=np.int64), np.zeros((n, 6), np.float32),
                             np.zeros((n, 6), np.int64), 0.01, 0.001)
        cases = {
            "decode plan": (lambda p=plan: M.encode_plan(p), M.plan_from_fields),
            "plan starting N seqs": (lambda p=start: M.encode_plan(p), M.plan_from_fields),
            "step result": (lambda r=result: M.encode_result(r), M.result_from_fields),
            "step result, top-5 logprobs": (lambda r=with_lp: M.encode_result(r), M.result_from_fields),
        }
        if n == seqs[0]:
            ids = np.arange(200, dtype=np.int64)
            cases["generate request"] = (lambda: M.encode("generate", request_id="r-1", prompt_token_ids=ids,
                                                          sampling=sampling, cache_salt=None), lambda f: f)
        for name, (enc, build) in cases.items():
            frames = [bytes(f) for f in enc()]
            e = timed(enc)
            d = timed(lambda: build(M.decode(frames)[1]))
            out[(name, n)] = (e, d)
            label = name if name == "generate request" else f"{name}, N={n}"
            print(f"codec  {label:40s} encode {e:8.1f} us   decode {d:8.1f} us", flush=True)
    return out


def measure(engine, n_seqs: int, steps: int) -> dict:
    from folio.runtime.common.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(n_seqs):
        engine.add_request(f"r{n_seqs}-{i}", None, sp, prompt_token_ids=[1 + (i % 1000), 2, 3])
    while engine.get_metrics()["num_running"] < n_seqs or engine.get_metrics()["num_waiting"]:
        engine.step()                      # prefill until every sequence decodes
    walls, overheads = [], []
    for _ in range(steps):
        f0, s0 = engine.stats["forward_time"], engine.stats["sample_time"]
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        walls.append(wall)
        overheads.append(wall - (engine.stats["forward_time"] - f0) - (engine.stats["sample_time"] - s0))
    engine.abort_request([f"r{n_seqs}-{i}" for i in range(n_seqs)])
    engine.step()
    return {"seqs": n_seqs, "steps_per_s": 1.0 / statistics.mean(walls),
            "overhead_us_mean": 1e6 * statistics.mean(overheads),
            "overhead_us_median": 1e6 * statistics.median(overheads)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--device", default="cpu")
    p.add_argument("--hop-only", action="store_true", help="only the echo-worker round trip")
    p.add_argument("--codec-only", action="store_true", help="only the wire codec, in this process")
    p.add_argument("--reps", type=int, default=2000, help="rounds of each --codec-only case")
    a = p.parse_args(argv)
    if a.codec_only:
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                   "?") if os.path.exists("/proc/cpuinfo") else "?"
        print(f"command: python perf/ipc_overhead.py {' '.join(argv if argv is not None else sys.argv[1:])}; "
              f"CPU {cpu}", flush=True)
        measure_codec(a.seqs, a.reps)
        return 0
    measure_hop(a.seqs, max(a.steps, 200))
    if a.hop_only:
        return 0
    from folio.ipc.zmq_executor import ZmqExecutor
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    model = tiny_model_dir()
    cfg = EngineConfig(model=model, device=a.device, load_format="dummy", max_num_seqs=max(a.seqs),
                       max_model_len=256, max_num_batched_tokens=4096, num_kv_blocks_override=8192,
                       enable_prefix_caching=False,
                       async_scheduling=False)  # one step at a time: wall minus forward is the overhead
    rows = []
    for mode in ("in-process", "zmq"):
        executor = ZmqExecutor(cfg) if mode == "zmq" else None
        engine = LLMEngine(cfg, executor=executor)
        measure(engine, 1, 5)              # warm-up (JIT, first allocations)
        for n in a.seqs:
            r = measure(engine, n, a.steps)
            r["mode"] = mode
            rows.append(r)
            print(f"{mode:10s} seqs={n:4d}  {r['steps_per_s']:8.1f} steps/s  overhead "
                  f"{r['overhead_us_mean']:8.0f} us/step mean, {r['overhead_us_median']:8.0f} median", flush=True)
        engine.shutdown()
    by = {(r["mode"], r["seqs"]): r for r in rows}
    for n in a.seqs:
        hop = by[("zmq", n)]["overhead_us_median"] - by[("in-process", n)]["overhead_us_median"]
        print(f"process hop at {n:4d} seqs: {hop:8.0f} us/step (median zmq overhead - median in-process overhead)")
    shutil.rmtree(model, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
