"""The engine's own per-step cost (issue 4, section 7): scheduler + plan + result + detokenizer.

Runs ``LLMEngine`` with the default model's tokenizer and a worker that does no model work
(``tests/ipc_fake_runner.EchoRunner``: each sampled row gets last input token + 1, so the text
keeps changing and the detokenizer does real work), with N running sequences in decode. Two modes:

  in-process: the echo runner called directly (pure engine overhead);
  zmq:        the echo runner in a worker process behind ``ZmqExecutor`` (+ the process hop).

Per mode and N it prints the median and mean wall time of ``engine.step()`` in microseconds, the
median CPU time of the engine's thread per step (``time.thread_time``: on a shared, loaded
machine this is the steadier figure; it leaves out the worker process and time spent waiting for
a core), and with ``--profile`` a cProfile listing of the in-process steps at the largest N.

    python perf/engine_overhead.py [--seqs 1 64 256] [--steps 100] [--modes in-process zmq] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def make_engine(mode: str, max_seqs: int):
    from folio.runtime.config import EngineConfig
    from folio.runtime.engine import LLMEngine
    cfg = EngineConfig(max_num_seqs=max_seqs, max_model_len=2048, max_num_batched_tokens=4096,
                       enable_prefix_caching=True, extra={"num_blocks": 8192})
    if mode == "zmq":
        from folio.ipc.executor import ZmqExecutor
        env = {**os.environ, "PYTHONPATH": TESTS + os.pathsep + os.environ.get("PYTHONPATH", "")}
        executor = ZmqExecutor(cfg, runner="ipc_fake_runner:EchoRunner", env=env)
    else:
        sys.path.insert(0, TESTS)
        from ipc_fake_runner import EchoRunner
        executor = EchoRunner(cfg)
    return LLMEngine(cfg, executor=executor)


def measure(engine, n_seqs: int, steps: int, profiler: cProfile.Profile | None = None
            ) -> tuple[list[float], list[float]]:
    """(wall seconds, thread CPU seconds) per ``engine.step()`` over ``steps`` decode steps of
    ``n_seqs`` sequences."""
    from folio.runtime.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"r{n_seqs}-{i}" for i in range(n_seqs)]
    for i, rid in enumerate(ids):
        prompt = [1000 + (7 * i + j) % 20000 for j in range(40)]   # 40 tokens: 3 blocks, a partial 4th
        engine.add_request(rid, None, sp, prompt_token_ids=prompt)
    while engine.get_metrics()["num_running"] < n_seqs or engine.get_metrics()["num_waiting"]:
        engine.step()                      # prefill until every sequence decodes
    ts, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        ts.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    engine.abort_request(ids)
    engine.step()
    return ts, cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--modes", nargs="+", default=["in-process", "zmq"], choices=["in-process", "zmq"])
    p.add_argument("--profile", action="store_true", help="cProfile the in-process steps at the largest N")
    a = p.parse_args(argv)
    print("command: python perf/engine_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    for mode in a.modes:
        engine = make_engine(mode, max(a.seqs))
        measure(engine, 4, 5)              # warm-up
        for n in a.seqs:
            prof = cProfile.Profile() if a.profile and mode == "in-process" and n == max(a.seqs) else None
            ts, cpu = measure(engine, n, a.steps, prof)
            print(f"{mode:10s} seqs={n:4d}  wall {1e6 * statistics.median(ts):8.0f} us/step median "
                  f"{1e6 * statistics.mean(ts):8.0f} mean  {1.0 / statistics.mean(ts):8.1f} steps/s  "
                  f"engine CPU {1e6 * statistics.median(cpu):8.0f} us/step median", flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
