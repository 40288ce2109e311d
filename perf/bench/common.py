"""Shared pieces of the benchmarks: workloads, thread pinning, an engine over one loaded model,
a step-by-step driver that records per-token times and KV counters, and a model-free executor.

Workloads use random token ids (like vLLM's ``benchmarks`` "random" dataset), drawn from
``[100, vocab_size - 100)`` so that no special token (SmolLM2's are < 20) is in a prompt; every
request sets ``ignore_eos`` so its output length is exactly the one drawn.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

THREAD_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


@dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
        prompt_token_ids: the prompt (token ids).
        output_len: tokens to generate (``max_tokens`` with ``ignore_eos``).
        arrival: arrival time in seconds after the start (0 for an offline batch).
    """

    prompt_token_ids: list[int]
    output_len: int
    arrival: float = 0.0


def random_requests(num: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                    vocab_size: int = 49152) -> list[BenchRequest]:
    """``num`` requests with prompt lengths uniform in ``input_len`` and output lengths uniform in
    ``output_len`` (both inclusive), random token ids, reproducible from ``seed``.

    Raises:
        ValueError: an empty or negative range, or ``num < 1``.
    """
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    for name, (lo, hi) in (("input_len", input_len), ("output_len", output_len)):
        if lo < 1 or hi < lo:
            raise ValueError(f"{name} range must satisfy 1 <= lo <= hi, got {lo}..{hi}")
    rng = np.random.default_rng(seed)
    plens = rng.integers(input_len[0], input_len[1] + 1, num)
    olens = rng.integers(output_len[0], output_len[1] + 1, num)
    return [BenchRequest(rng.integers(100, vocab_size - 100, int(p)).tolist(), int(o))
            for p, o in zip(plens, olens)]


def poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int) -> list[BenchRequest]:
    """Copies of ``requests`` with Poisson arrivals (exponential gaps, mean ``1/rate`` seconds;
    the first arrives at 0)."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, len(requests))
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    return [BenchRequest(r.prompt_token_ids, r.output_len, float(t)) for r, t in zip(requests, times)]


def all_cores() -> int:
    """The number of cores this process may run on (``os.sched_getaffinity``): the default thread
    count of every engine in a comparison."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def threads_env_ok(threads: int) -> bool:
    """Whether this process was started with every thread-pool variable set to ``threads``."""
    return all(os.environ.get(k) == str(threads) for k in THREAD_ENV)


def reexec_with_threads(threads: int) -> None:
    """Restart this command with BLAS / OpenMP / Numba pools of ``threads`` threads.

    The pools are sized when numpy/numba load, before the command line is parsed, so the
    setting can only take effect in a fresh process. On a loaded 2-core machine OpenBLAS's
    2-thread sgemm of a decode step's small matrices ran ~10x slower than 1 thread (measured:
    16x576 @ 576x1536, 19 ms vs 1.5 ms), so every engine in a comparison gets the same count.
    """
    if threads_env_ok(threads):
        return
    env = dict(os.environ)
    for k in THREAD_ENV:
        env[k] = str(threads)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "folio.cli", *sys.argv[1:]], env)


def peer_env(threads: int) -> dict:
    """The environment of a peer process (transformers, llama.cpp): the OpenMP wait policy that
    folio's CPU kernels set for themselves removed (the peer runs with its own defaults), the
    thread-count variables set to ``threads``."""
    env = dict(os.environ)
    if env.pop("OMP_WAIT_POLICY_SET_BY_FOLIO", None):
        env.pop("OMP_WAIT_POLICY", None)
    for k in THREAD_ENV:
        env[k] = str(threads)
    return env


class BusyProcesses:
    """``n`` processes that spin on a core each for the life of the ``with`` block: the
    "loaded machine" of the thread-scaling measurement (another program wanting the cores)."""

    def __init__(self, n: int):
        self.n = n
        self.procs = []

    def __enter__(self):
        import subprocess
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []


def command_line() -> str:
    """The command that made this run, as the user would type it."""
    return "folio " + " ".join(_quote(a) for a in sys.argv[1:])


def _quote(a: str) -> str:
    import shlex
    return shlex.quote(a)


def blas_kernels() -> str | None:
    """Which kernels the loaded OpenBLAS runs (its core type, e.g. ``SkylakeX``: AVX-512;
    ``Haswell``: AVX2), and ``OPENBLAS_CORETYPE`` when the environment forces it (OpenBLAS then
    skips its own CPU detection: on an AVX-512 CPU ``Haswell`` halves sgemm). None when no
    OpenBLAS is loaded."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # pragma: no cover - a dependency
        return None
    arch = next((i.get("architecture") for i in threadpool_info() if i.get("internal_api") == "openblas"), None)
    if arch is None:
        return None
    forced = os.environ.get("OPENBLAS_CORETYPE")
    return f"{arch} (OPENBLAS_CORETYPE={forced} in the environment)" if forced else arch


def cpu_fields(cpuinfo: str | None = None) -> dict:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (or of ``cpuinfo``);
    empty when the file cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_flags(cpuinfo: str | None = None) -> set:
    """The first processor's ``flags`` (``cpu_fields``); empty when there are none."""
    return set(cpu_fields(cpuinfo).get("flags", "").split())


def machine_info() -> dict:
    """CPU model, core count, load average (figures on a shared machine are noisy) and the
    OpenBLAS kernels (``blas_kernels``)."""
    info = {"cores": os.cpu_count(), "python": sys.version.split()[0]}
    kernels = blas_kernels()
    if kernels:
        info["blas_kernels"] = kernels
    fields = cpu_fields()
    flags = set(fields.get("flags", "").split())
    simd = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX")) if flag in flags),
                None)
    extra = ", ".join(x for x in (f"family {fields['cpu family']} model {fields['model']}"
                                  if "cpu family" in fields and "model" in fields else None, simd) if x)
    if "model name" in fields:
        info["cpu"] = fields["model name"] + (f" ({extra})" if extra else "")
    try:
        info["loadavg_1m"] = os.getloadavg()[0]
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


# ----------------------------------------------------------------------------------------------
# Engines over one loaded model
# ----------------------------------------------------------------------------------------------

class ModelHost:
    """One loaded model and KV cache (a ``ModelRunner``) shared by many engines.

    Each benchmark run builds a fresh ``LLMEngine`` (own scheduler, block pool and prefix cache)
    over the same runner, so loading happens once. Scheduler-side settings (policy, budget,
    prefix caching, max_num_seqs) may differ per engine; block size, max_model_len and the number
    of blocks are the runner's.

    Args:
        model: folio model name or folder. max_model_len: tokens. num_blocks: KV blocks.
        block_size: tokens per block. device: "cpu" / "cuda" / "auto". kv_cache_dtype: as
        ``--kv-cache-dtype``. engine_args: any other ``EngineConfig`` field (``dtype``,
        ``activation_quantization``, ...).
    """

    def __init__(self, model: str, max_model_len: int, num_blocks: int, block_size: int = 16,
                 device: str = "cpu", load_format: str = "auto", kv_cache_dtype: str = "auto", **engine_args):
        from folio.runtime.common.config import EngineConfig
        from folio.runtime.worker.model_runner import ModelRunner
        self.base = dict(model=model, device=device, block_size=block_size, max_model_len=max_model_len,
                         num_kv_blocks_override=num_blocks, load_format=load_format, kv_cache_dtype=kv_cache_dtype,
                         **engine_args)
        t0 = time.perf_counter()
        self.runner = ModelRunner(EngineConfig(**self.base, max_num_batched_tokens=max(2048, max_model_len)))
        self.load_s = time.perf_counter() - t0
        self.tokenizer = None
        self.warm_up_s: float | None = None

    def warm_up(self) -> float:
        """Compile (or load from Numba's cache) every kernel before a timed run: a throwaway engine
        runs ``LLMEngine.warm_up()``'s requests. Once per host; later calls return at once.
        Without it the first timed run of a fresh checkout includes ~1-2 minutes of compilation.
        Returns:
            the seconds the first call took (compilation included).
        """
        if self.warm_up_s is None:
            t0 = time.perf_counter()
            self.engine().warm_up()
            self.warm_up_s = time.perf_counter() - t0
        return self.warm_up_s

    @property
    def num_blocks(self) -> int:
        return int(self.runner.num_blocks)

    @property
    def model_dir(self):
        return self.runner.model_dir

    def engine(self, policy: str = "continuous", **scheduler_args):
        """A new ``LLMEngine`` over this model (``scheduler_args``: EngineConfig fields;
        ``policy``: ``"continuous"`` or ``"static"``, see ``static_batching.py``)."""
        from folio.runtime.common.config import EngineConfig
        from folio.runtime.scheduler.engine import LLMEngine
        from .static_batching import SCHEDULERS
        cfg = EngineConfig(**{**self.base, **scheduler_args})
        eng = LLMEngine(cfg, executor=self.runner, tokenizer=self.tokenizer, scheduler_cls=SCHEDULERS[policy])
        self.tokenizer = eng.tokenizer
        return eng


class ReplayExecutor:
    """A model-free executor: answers every sampled row with token ``token_id`` at once.

    It lets a request trace go through folio's real scheduler, block pool and KV cache manager
    (section 1) with no forward pass; with ``ignore_eos`` outputs the block bookkeeping is the
    same as in a real run of the same trace.
    """

    def __init__(self, num_blocks: int, model_config, token_id: int = 1000):
        self.num_blocks = num_blocks
        self.model_config = model_config
        self.model_dir = None
        self.token_id = token_id

    def execute(self, plan):
        from folio.runtime.common.step import StepResult
        n = len(np.asarray(plan.logits_indices))
        return StepResult(plan.step_id, np.full(n, self.token_id, dtype=np.int64))

    def shutdown(self):
        pass


def replay_engine(num_blocks: int, model_config, tokenizer, **config_args):
    """An ``LLMEngine`` over a ``ReplayExecutor`` (real scheduler and block pool, no model)."""
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.scheduler.engine import LLMEngine
    cfg = EngineConfig(device="cpu", num_kv_blocks_override=num_blocks, **config_args)
    return LLMEngine(cfg, executor=ReplayExecutor(num_blocks, model_config), tokenizer=tokenizer)


# ----------------------------------------------------------------------------------------------
# The step driver
# ----------------------------------------------------------------------------------------------

@dataclass
class TraceResult:
    """What one run of a trace through an engine measured.

    Times are seconds from the run's start (``time.perf_counter``); with ``realtime=False`` the
    "time" of the model-free replay is the step index.

    Attributes:
        wall_s: run time. arrivals / first_token / finish: per request id. token_times: per request
            id, the time each output token (summed over its n samples) was returned.
        kv: per step ``(t, kv_tokens_held, kv_tokens_allocated, num_running, blocks_in_use)``.
        outputs: final ``RequestOutput`` per request id. metrics: ``engine.get_metrics()`` at the end.
    """

    wall_s: float = 0.0
    num_steps: int = 0
    arrivals: dict = field(default_factory=dict)
    first_token: dict = field(default_factory=dict)
    finish: dict = field(default_factory=dict)
    token_times: dict = field(default_factory=dict)
    kv: list = field(default_factory=list)
    outputs: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)

    def output_tokens(self) -> int:
        return sum(len(c.token_ids) for o in self.outputs.values() for c in o.outputs)

    def latencies(self) -> np.ndarray:
        return np.array([self.finish[r] - self.arrivals[r] for r in self.finish])

    def ttfts(self) -> np.ndarray:
        return np.array([self.first_token[r] - self.arrivals[r] for r in self.first_token])

    def itls(self, ids=None) -> np.ndarray:
        ids = self.token_times.keys() if ids is None else ids
        gaps = [np.diff(self.token_times[r]) for r in ids if len(self.token_times[r]) > 1]
        return np.concatenate(gaps) if gaps else np.zeros(0)

    def kv_waste(self) -> float:
        """1 - (token slots holding K/V) / (token slots in blocks in use), summed over steps."""
        held = sum(k[1] for k in self.kv)
        alloc = sum(k[2] for k in self.kv)
        return 1.0 - held / alloc if alloc else 0.0


def run_trace(engine, requests: list[BenchRequest], params_for, realtime: bool = False,
              sample_kv: bool = False, on_step=None, inject=None, progress=None,
              step_clock: bool = False) -> TraceResult:
    """Drive ``engine`` step by step through ``requests`` and record what happened.

    Args:
        engine: an ``LLMEngine``.
        requests: the trace; request ``i`` gets id ``str(i)``.
        params_for: ``BenchRequest -> SamplingParams``.
        realtime: add each request when the wall clock reaches its ``arrival`` (Poisson traces);
            otherwise all are added at the start (offline batch).
        sample_kv: record the KV counters after every step (cost: one pass over running blocks).
        inject: optional ``(TraceResult, step_index) -> list[(id, BenchRequest, SamplingParams)]``
            called before each step, for requests that arrive on a condition (section 6).
        progress: a tqdm bar updated per finished request.
        step_clock: time is the step index, not seconds (the model-free replay).
    Returns:
        a ``TraceResult``.
    """
    from folio.runtime.common.outputs import RequestOutput
    res = TraceResult()
    deltas: dict[str, list] = {}
    start = time.perf_counter()
    clock = (lambda: float(res.num_steps)) if step_clock else (lambda: time.perf_counter() - start)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    nxt = 0
    gate = realtime or step_clock

    def add(rid, req, sp):
        engine.add_request(rid, None, sp, prompt_token_ids=req.prompt_token_ids)
        res.arrivals[rid] = clock()
        res.token_times[rid] = []

    while True:
        now = clock()
        while nxt < len(order):
            i = order[nxt]
            if gate and requests[i].arrival > now:
                break
            add(str(i), requests[i], params_for(requests[i]))
            if gate:
                res.arrivals[str(i)] = requests[i].arrival
            nxt += 1
        if inject is not None:
            for rid, req, sp in inject(res, res.num_steps):
                add(rid, req, sp)
        if not engine.has_unfinished_requests():
            if nxt >= len(order):
                break
            if step_clock:  # idle steps pass until the next arrival
                res.num_steps = max(res.num_steps + 1, int(np.ceil(requests[order[nxt]].arrival)))
            else:
                time.sleep(max(0.0, requests[order[nxt]].arrival - clock()))
            continue
        outs = engine.step()
        res.num_steps += 1
        t = clock()
        for delta in outs:
            rid = delta.request_id
            deltas.setdefault(rid, []).append(delta)
            n_new = sum(len(c.token_ids) for c in delta.outputs)
            if n_new:
                res.token_times.setdefault(rid, []).extend([t] * n_new)
                res.first_token.setdefault(rid, t)
            if delta.finished:
                res.finish[rid] = t
                res.outputs[rid] = RequestOutput.from_deltas(deltas.pop(rid))
                if progress is not None:
                    progress.update(1)
        if sample_kv:
            m = engine.get_metrics()
            res.kv.append((t, m["kv_tokens_held"], m["kv_tokens_allocated"], m["num_running"],
                           m["num_total_blocks"] - m["num_free_blocks"]))
        if on_step is not None:
            on_step(res, engine)
    res.wall_s = time.perf_counter() - start
    res.metrics = engine.get_metrics()
    return res


def ignore_eos_params(req: BenchRequest, **kw):
    """``SamplingParams`` of a benchmark request: greedy, exactly ``output_len`` tokens."""
    from folio.runtime.common.sampling_params import SamplingParams
    return SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=kw.pop("temperature", 0.0),
                          **kw)


def percentile(a, q) -> float:
    a = np.asarray(a, dtype=np.float64)
    return float(np.percentile(a, q)) if a.size else float("nan")
