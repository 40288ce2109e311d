"""The engine's own per-step cost (issues 4 and 10): scheduler, plan, result, detokenizer, deltas.

Runs ``LLMEngine`` with the default model's tokenizer and a worker that does no model work
(``tests/support/ipc_fake_runner.EchoRunner``: each sampled row gets its last input token + 1, wrapped into
4096 ids as a model's outputs come from a bounded vocabulary, so the text keeps changing and the
detokenizer does real work on warm caches), with N running sequences in decode. Two modes:

  in-process: the echo runner in this process (pure engine overhead);
  zmq:        the echo runner in a worker process behind ``ZmqExecutor`` (+ the process hop).

Per mode and N it prints the median and mean wall time of ``engine.step()`` in microseconds and
the median CPU time of the engine's thread per step (``time.thread_time``: on a shared, loaded
machine this is the steadier figure; it leaves out the worker, whether a process or the overlap
thread, and time spent waiting for a core), and with ``--profile`` a cProfile listing of the
in-process steps at the largest N. ``--json PATH`` writes
``{"in-process": {"<N>": {"thread_cpu_us": ..., "wall_us": ...}}, "zmq": {...}, "meta": {...}}``.

``--package-dir DIR --tests-dir DIR`` measure another version of folio (its package first on the
path, its echo runner), e.g. the code before a change, in the same sitting as the current one.

    python perf/engine_overhead.py [--seqs 64 256] [--steps 100] [--modes in-process zmq]
                                   [--no-async-scheduling] [--json PATH] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import platform
import pstats
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ECHO_PERIOD = 4096  # distinct output ids of the echo worker (see its echo_period)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def make_engine(mode: str, max_seqs: int, tests_dir: str, async_scheduling: bool | None):
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    kw = dict(max_num_seqs=max_seqs, max_model_len=2048, max_num_batched_tokens=4096,
              enable_prefix_caching=True)
    if async_scheduling is not None and "async_scheduling" in {f.name for f in dataclasses.fields(EngineConfig)}:
        kw["async_scheduling"] = async_scheduling
    cfg = EngineConfig(**kw)
    if mode == "zmq":
        from folio.ipc.zmq_executor import ZmqExecutor
        path = tests_dir + os.pathsep + os.environ.get("PYTHONPATH", "")
        executor = ZmqExecutor(cfg, runner="support.ipc_fake_runner:EchoRunner",
                               env={**os.environ, "PYTHONPATH": path, "FOLIO_ECHO_NUM_BLOCKS": "8192",
                                    "FOLIO_ECHO_PERIOD": str(ECHO_PERIOD)})
    else:
        from support.ipc_fake_runner import EchoRunner
        executor = EchoRunner(cfg, num_blocks=8192, echo_period=ECHO_PERIOD)
    return LLMEngine(cfg, executor=executor)


def measure(engine, n_seqs: int, steps: int, profiler: cProfile.Profile | None = None
            ) -> tuple[list[float], list[float]]:
    """(wall seconds, thread CPU seconds) per ``engine.step()`` over ``steps`` decode steps of
    ``n_seqs`` sequences."""
    from folio.runtime.common.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    ids = [f"r{n_seqs}-{i}-{time.monotonic_ns()}" for i in range(n_seqs)]
    for i, rid in enumerate(ids):
        prompt = [1000 + (7 * i + j) % 20000 for j in range(40)]   # 40 tokens: 3 blocks, a partial 4th
        engine.add_request(rid, None, sp, prompt_token_ids=prompt)
    while engine.get_metrics()["num_running"] < n_seqs or engine.get_metrics()["num_waiting"]:
        engine.step()                      # prefill until every sequence decodes
    for _ in range(3):
        engine.step()
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
    while engine.has_unfinished_requests():
        engine.step()
    return ts, cpu


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--modes", nargs="+", default=["in-process", "zmq"], choices=["in-process", "zmq"])
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling on/off (default: the engine's default)")
    p.add_argument("--json", metavar="PATH", help="write the medians as JSON")
    p.add_argument("--profile", action="store_true", help="cProfile the in-process steps at the largest N")
    p.add_argument("--package-dir", help="put this folio package's parent first on the path (another version)")
    p.add_argument("--tests-dir", default=os.path.join(ROOT, "tests"), help="the tests folder (support/ipc_fake_runner.py)")
    a = p.parse_args(argv)
    if a.package_dir:
        sys.path.insert(0, os.path.abspath(a.package_dir))
        os.environ["PYTHONPATH"] = os.path.abspath(a.package_dir) + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, a.tests_dir)
    import folio
    command = "python perf/engine_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load = os.getloadavg()[0]
    print(f"command: {command}")
    print(f"folio from {os.path.dirname(folio.__file__)}; cpu {cpu_model()}; load average {load:.1f} "
          f"on {os.cpu_count()} cpus")
    results: dict = {"meta": {"command": command, "cpu": cpu_model(), "num_cpus": os.cpu_count(),
                              "load_average_start": load, "steps": a.steps, "async_scheduling": a.async_scheduling,
                              "folio": os.path.dirname(folio.__file__)}}
    for mode in a.modes:
        engine = make_engine(mode, max(a.seqs), a.tests_dir, a.async_scheduling)
        measure(engine, 4, 5)              # warm-up
        results[mode] = {}
        for n in a.seqs:
            prof = cProfile.Profile() if a.profile and mode == "in-process" and n == max(a.seqs) else None
            ts, cpu = measure(engine, n, a.steps, prof)
            results[mode][str(n)] = {"thread_cpu_us": round(1e6 * statistics.median(cpu), 1),
                                     "wall_us": round(1e6 * statistics.median(ts), 1),
                                     "wall_mean_us": round(1e6 * statistics.mean(ts), 1)}
            print(f"{mode:10s} seqs={n:4d}  wall {1e6 * statistics.median(ts):8.0f} us/step median "
                  f"{1e6 * statistics.mean(ts):8.0f} mean  {1.0 / statistics.mean(ts):8.1f} steps/s  "
                  f"engine CPU {1e6 * statistics.median(cpu):8.0f} us/step median", flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        engine.shutdown()
    save_json(results, a.json)
    return 0


def save_json(results: dict, path: str | None) -> None:
    """Stamp the end load average into ``results["meta"]`` and write it to ``path`` (if any)."""
    results["meta"]["load_average_end"] = os.getloadavg()[0]
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
