"""The worker's idle time between steps, with and without overlap scheduling (issue 10).

While the engine applies step N's result and schedules step N+1, a worker without overlap waits.
With overlap (``async_scheduling``, the default) plan N+1 is already queued at the worker when
step N ends. This drives N decoding sequences through ``LLMEngine`` + ``ZmqExecutor`` (the
serving configuration: the worker is another process) and reports, over ``--steps`` steady-state
steps, the worker's idle time as a share of the step cycle::

    idle share = sum of the worker's idle time before each plan / wall time of the steps

(the idle time is measured by the worker: from sending a result to receiving the next plan). As
``folio serve`` does, the objects built at start-up are frozen out of the garbage collector's
passes before measuring.

Workers: ``echo`` (``tests/support/ipc_fake_runner.EchoRunner``: no model; its forward pass is a sleep of
``--step-ms``, standing for a GPU's step, so only the engine's own time can leave it idle) and
``model`` (the real default model on this machine's CPU).

    python perf/worker_idle.py [--worker echo --step-ms 5 | --worker model] [--seqs 64 256] [--steps 60]
                               [--prompt-len 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "perf"))
from engine_overhead import ECHO_PERIOD, cpu_model, save_json  # noqa: E402


def make_engine(worker: str, n: int, overlap: bool, step_ms: float):
    from folio.ipc.zmq_executor import ZmqExecutor
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    if worker == "echo":
        cfg = EngineConfig(max_num_seqs=n, max_model_len=2048, max_num_batched_tokens=4096,
                           async_scheduling=overlap)
        tests = os.path.join(ROOT, "tests")
        env = {**os.environ, "PYTHONPATH": tests + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "FOLIO_ECHO_NUM_BLOCKS": "8192", "FOLIO_ECHO_STEP_S": str(step_ms / 1000),
               "FOLIO_ECHO_PERIOD": str(ECHO_PERIOD)}
        ex = ZmqExecutor(cfg, runner="support.ipc_fake_runner:EchoRunner", env=env)
    else:
        cfg = EngineConfig(device="cpu", max_num_seqs=n, max_model_len=256, max_num_batched_tokens=2048,
                           async_scheduling=overlap, kv_cache_memory=256 << 20)
        ex = ZmqExecutor(cfg)
    return LLMEngine(cfg, executor=ex)


def measure(engine, n: int, steps: int, prompt_len: int = 40) -> dict:
    from folio.runtime.common.sampling_params import SamplingParams
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 40, ignore_eos=True)
    ids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, None, sp, prompt_token_ids=[1000 + (7 * i + j) % 20000 for j in range(prompt_len)])
    while engine.get_metrics()["num_running"] < n or engine.get_metrics()["num_waiting"]:
        engine.step()
    for _ in range(5):
        engine.step()
    m0, t0, c0 = engine.get_metrics(), time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    m1, t1, c1 = engine.get_metrics(), time.perf_counter(), time.thread_time()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    k = m1["num_steps"] - m0["num_steps"]
    idle = m1["worker_idle_time"] - m0["worker_idle_time"]
    busy = m1["worker_busy_time"] - m0["worker_busy_time"]
    wall = t1 - t0
    return {"steps": k, "idle_share": idle / wall, "idle_us_per_step": 1e6 * idle / k,
            "step_wall_us": 1e6 * wall / k, "worker_busy_us_per_step": 1e6 * busy / k,
            "engine_cpu_us_per_step": 1e6 * (c1 - c0) / k, "tokens_per_s": n * k / wall}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["echo", "model"], default="echo")
    p.add_argument("--step-ms", type=float, default=5.0, help="echo worker: simulated forward time per step")
    p.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompt-len", type=int, default=40, help="prompt tokens per sequence")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    command = "python perf/worker_idle.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"command: {command}")
    print(f"cpu {cpu_model()}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    out = {"meta": {"command": command, "cpu": cpu_model(), "load_average_start": os.getloadavg()[0],
                    "worker": a.worker, "step_ms": a.step_ms if a.worker == "echo" else None}}
    for n in a.seqs:
        for overlap in (False, True):
            engine = make_engine(a.worker, n, overlap, a.step_ms)
            gc.collect()
            gc.freeze()   # as folio serve does after start-up (ipc/scheduler_process.py)
            try:
                r = measure(engine, n, a.steps, a.prompt_len)
            finally:
                engine.shutdown()
            out.setdefault(str(n), {})["overlap" if overlap else "no_overlap"] = r
            print(f"seqs={n:4d} overlap={'on ' if overlap else 'off'}  worker idle {100 * r['idle_share']:5.1f}% "
                  f"of the step ({r['idle_us_per_step']:7.0f} us idle / {r['step_wall_us']:8.0f} us per step), "
                  f"worker forward+sample {r['worker_busy_us_per_step']:8.0f} us, engine CPU "
                  f"{r['engine_cpu_us_per_step']:6.0f} us/step, {r['tokens_per_s']:8.0f} tok/s", flush=True)
    save_json(out, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
