"""The GPU step path (runtime/worker/device_step.py, ModelRunner on the CUDA table) run on the CPU: the
CUDA table under the SIMT emulator with a device that counts every launch, host<->device copy and
sync, and a NumPy "device memory" whose allocations are accounted like CuPy's pool.

What a GPU alone can show (timings, that CUDA accepts the graph capture) is left to
perf/gpu_check.sh; everything about what is launched, copied and synchronised, and what the
results are, is checked here.
"""

from __future__ import annotations

import sys
import weakref
from types import SimpleNamespace

import numpy as np
import pytest

from folio.kernels.cuda import sources as cuda_sources
from folio.kernels.cuda import table as cuda_ops
from folio.kernels.cuda.device import HostDevice
from folio.runtime.worker.model_runner import gpu_kv_budget, max_useful_blocks, profile_step_shape
from folio.runtime.worker.sampler import (SamplingState, max_logprobs, penalty_entries, sample, sample_on_device,
                                   sampling_arrays)
from folio.runtime.common.sampling_params import SamplingParams
from support.device_cases import BS, TINY, CountingDevice, Seq, make_runner, make_table, model_dir, plan_for


class FakeXP:
    """NumPy as a device array module with CuPy-pool-like accounting: allocations count as in
    use until freed, then stay held (cached) by the pool; ``peak`` follows the in-use bytes."""

    def __init__(self):
        self.in_use = self.held_free = self.peak = 0
        self.allocs = 0

    def __getattr__(self, name):
        return getattr(np, name)

    def _track(self, a):
        n = a.nbytes
        self.allocs += 1
        if self.held_free >= n:  # the pool reuses a cached block
            self.held_free -= n
        self.in_use += n
        self.peak = max(self.peak, self.in_use)

        def free(n=n):
            self.in_use -= n
            self.held_free += n

        weakref.finalize(a, free)
        return a

    def empty(self, shape, dtype=float, **kw):
        return self._track(np.empty(shape, dtype=dtype, **kw))

    def zeros(self, shape, dtype=float, **kw):
        return self._track(np.zeros(shape, dtype=dtype, **kw))

    def empty_like(self, a, dtype=None):
        return self._track(np.empty_like(a, dtype=dtype))


class FakeMemoryDevice(CountingDevice):
    """A device of ``total_bytes`` with ``context_bytes`` outside the pool (the CUDA context)."""

    def __init__(self, xp: FakeXP, total_bytes: int, context_bytes: int):
        super().__init__(total_bytes=total_bytes)
        self.fx = xp
        self.context_bytes = context_bytes

    def empty(self, shape, dtype):
        return self.fx.empty(shape, dtype=dtype)

    def memory(self):
        held = self.fx.in_use + self.fx.held_free
        return self.total_bytes - self.context_bytes - held, self.total_bytes, held

    def peak_tracker(self):
        fx = self

        class _Peak:
            def __enter__(self):
                fx.fx.peak = fx.fx.in_use
                return self

            def __exit__(self, *exc):
                self.peak = fx.fx.peak

        return _Peak()


def run_steps(runner, seqs, n_decode, chunk=None):
    """Prefill (chunked by ``chunk``) then ``n_decode`` decode steps; returns per step (result,
    counts)."""
    out = []
    step = 0
    first = True
    while any(s.done < len(s.tokens) for s in seqs):
        res = runner.execute(plan_for(step, seqs, new=seqs if first else (), chunk=chunk))
        assert res.error is None, res.error
        first = False
        step += 1
        out.append((res, runner.kernels.device.take()))
    for s, t in zip(seqs, out[-1][0].sampled_token_ids.tolist()):
        s.tokens.append(t)
    for _ in range(n_decode):
        res = runner.execute(plan_for(step, seqs))
        assert res.error is None, res.error
        step += 1
        out.append((res, runner.kernels.device.take()))
        for s, t in zip(seqs, res.sampled_token_ids.tolist()):
            s.tokens.append(t)
    return out


def _seqs(params_list):
    rng = np.random.default_rng(0)
    return [Seq(i, rng.integers(3, 200, 5 + 7 * i).tolist(), list(range(6 * i, 6 * i + 6)), p, seed=10 + i)
            for i, p in enumerate(params_list)]


PARAMS = [SamplingParams(temperature=0.0, max_tokens=8),
          SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=3, logprobs=2),
          SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.3, frequency_penalty=0.4,
                         presence_penalty=0.2, min_tokens=3)]


def test_one_upload_one_download_one_sync_per_step(modules, tmp_path, monkeypatch):
    dev = CountingDevice()
    runner = make_runner(monkeypatch, make_table(modules, dev), model_dir(tmp_path))
    dev.take()
    steps = run_steps(runner, _seqs(PARAMS), n_decode=3, chunk=9)
    assert len(steps) >= 6
    for res, c in steps:
        assert (c["h2d"], c["d2h"], c["sync"]) == (1, 1, 1), c
    runner.shutdown()


def _launches_and_allocs_per_step(modules, tmp_path, monkeypatch, layers, eager):
    """Launches of each step of the same run, and the device allocations of one more decode step."""
    fx = FakeXP()
    dev = FakeMemoryDevice(fx, 1 << 34, 0)
    runner = make_runner(monkeypatch, make_table(modules, dev, xp=fx), model_dir(tmp_path, num_hidden_layers=layers),
                         enforce_eager=eager)
    dev.take()
    seqs = _seqs([SamplingParams(temperature=0.0)] * 3)
    launches = [c["launch"] for _, c in run_steps(runner, seqs, n_decode=4)]
    a0 = fx.allocs
    res = runner.execute(plan_for(99, seqs))
    assert res.error is None
    allocs = fx.allocs - a0
    runner.shutdown()
    return launches, allocs


def test_launches_per_layer_and_no_allocation_per_layer(modules, tmp_path, monkeypatch):
    # the same steps on 2- and 3-layer models: what a layer adds is the difference
    l2, a2 = _launches_and_allocs_per_step(modules, tmp_path, monkeypatch, 2, eager=True)
    l3, a3 = _launches_and_allocs_per_step(modules, tmp_path, monkeypatch, 3, eager=True)
    per_layer = [b - a for a, b in zip(l2, l3)]
    assert all(n <= 10 for n in per_layer), per_layer  # prefill 9, decode 9 (10 with split-K)
    assert a3 == a2, (a2, a3)  # the per-layer loop allocates nothing


@pytest.mark.parametrize("buffer_moves", [None, "upload", "workspace"])
def test_decode_graph_replays_equal_eager_steps(modules, tmp_path, monkeypatch, buffer_moves):
    # three sequences (a batch bucket of 4 with one padding row), greedy and seeded random rows,
    # logprobs: the captured decode graph, replayed with each step's new inputs, gives the eager
    # steps' tokens and logprobs. When the upload buffer is reallocated between decode steps (a
    # larger step came in between), the graphs holding its old address are dropped and captured
    # again on the new one. The same when the model's workspace is reallocated (the graphs key on
    # its generation counter: its replacement is made right after the old one is freed, so it may
    # get the same id(), though this test cannot force CPython to reuse it)
    results = {}
    for eager in (True, False):
        dev = CountingDevice()
        table = make_table(modules, dev)
        runner = make_runner(monkeypatch, table, model_dir(tmp_path), enforce_eager=eager)
        if eager:   # the final norm's and the lm_head's bf16 weights, for the bound below
            g = cuda_ops.bf16_bits_to_float32(table.to_numpy(runner.model.norm)).astype(np.float64)
            w = cuda_ops.bf16_bits_to_float32(table.to_numpy(runner.model.lm_head)).astype(np.float64)
        seqs = _seqs(PARAMS)
        steps = run_steps(runner, seqs, n_decode=2)
        if buffer_moves == "upload":
            runner.device_step.inp.ensure(4 * runner.device_step.inp.nbytes)
        elif buffer_moves == "workspace":
            tokens, rows = runner.model.workspace.tokens, runner.model.workspace.rows  # (no reference kept)
            runner.model.workspace_for(2 * tokens, rows)
        for k in range(2):
            res = runner.execute(plan_for(50 + k, seqs))
            assert res.error is None, res.error
            steps.append((res, dev.take()))
            for sq, t in zip(seqs, res.sampled_token_ids.tolist()):
                sq.tokens.append(t)
        results[eager] = [(r.sampled_token_ids, r.logprobs, r.logprob_token_ids) for r, _ in steps]
        if not eager:
            ds = runner.device_step
            assert ds.graph_error is None
            assert set(ds.graphs) == {(4, 1)}
            launches = [c["launch"] for _, c in steps]
        runner.shutdown()
    # The graph's products multiply 4 rows (one padding), the eager ones 3: NumPy's sgemm may sum in
    # another order. Every layer hands its products bf16 inputs, so the rows reaching the lm_head
    # are the same in both (a float32 difference would have to flip a bf16 rounding, and then the
    # logprobs would differ by ~2^-8 relative and fail here). The lm_head's H = 64 bf16 products are
    # exact in float32; each run's sum is within gamma_63 sum_k |x_k w_jk| of the exact one, and by
    # Cauchy-Schwarz sum_k |x_k w_jk| <= |x| |w_j| with |x| <= sqrt(H) max|g| (1 + 2^-8): the final
    # RMSNorm's row has norm sqrt(H) before its weight g and the bf16 rounding. A logit moves by at
    # most D = 2 gamma_63 sqrt(H) max|g| (1 + 2^-8) max_j |w_j|, the log-sum-exp by at most D too,
    # so a logprob by 2 D, plus each run's own log-softmax rounding (log_softmax_bound).
    H, V = w.shape[1], w.shape[0]
    D = 2 * (H - 1) * 2.0 ** -24 / (1 - (H - 1) * 2.0 ** -24) * np.sqrt(H) * np.abs(g).max() * (1 + 2.0 ** -8) \
        * np.sqrt((w * w).sum(1)).max()
    for (a, la, ia), (b, lb, ib) in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_less(np.abs(la.astype(np.float64) - lb), 2 * D + 2 * log_softmax_bound(la, V))
    # steady decode steps launch the graph and the sampler's kernels; the first decode step and
    # the first after the buffer moved also warm up and capture (a full forward each)
    assert launches[-1] <= 3 and launches[-3] <= 3 and launches[1] > 2 * 9 * 2, launches
    assert (launches[-2] == launches[1]) if buffer_moves else (launches[-2] <= 3), launches


def log_softmax_bound(lp, V):
    """Bound on a float32 log-softmax's error at exact log-probabilities ``lp`` of a ``V``-token
    row, in any summation order (u = 2^-24): z = l - max rounds by u |z|; each exp within 4 ulp
    (NumPy's float32 exp and log are under 4 ulp, CUDA's expf and logf within 2), 8u relative; the
    sum S of V positive terms within gamma_{V-1} + 8u relative, so log S within that absolute, plus
    log's own 8u log S; the last subtraction u |lp|. |z| <= |lp| + log S and S <= V (every term is
    at most 1): u (2 |lp| + 9 log V) + gamma_{V-1} + 8u."""
    u = 2.0 ** -24
    return u * (2 * np.abs(lp) + 9 * np.log(V)) + (V - 1) * u / (1 - (V - 1) * u) + 8 * u


def test_device_sampler_matches_the_numpy_sampler(modules):
    from folio.runtime.worker.sampler import log_softmax
    from support.cuda_bounds import check_gumbel_picks

    # the same logits and states (separate, identically seeded generators) through runtime/sampler's
    # NumPy pipeline and through the CUDA table's kernels
    kt = make_table(modules, HostDevice())
    rng = np.random.default_rng(7)
    V = 300
    logits = (rng.standard_normal((9, V)) * 3).astype(np.float32)
    cases = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
             dict(temperature=0.8, top_p=0.6), dict(temperature=1.2, top_k=40, top_p=0.9),
             dict(temperature=1.0, min_p=0.2), dict(temperature=1.0, top_k=1),
             dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5, min_tokens=12),
             dict(temperature=1.3, frequency_penalty=0.7, top_p=0.95, logprobs=3, min_tokens=12, stop_token_ids=[5])]
    logits[7:, [2, 5, 7]] = 30.0  # EOS (2, 7) and a stop token (5) win unless min_tokens masks them

    def states():
        out = []
        for i, kw in enumerate(cases):
            prompt = rng_p.integers(0, V, 6 + i).tolist()
            produced = rng_p.integers(0, V, i).tolist()
            out.append(SamplingState(i, SamplingParams(**kw), prompt, produced, 100 + i, [2, 7]))
        return out

    rng_p = np.random.default_rng(1)
    st_a = states()
    rng_p = np.random.default_rng(1)
    st_b = states()
    want = sample(logits.copy(), st_a)
    params, uniforms = sampling_arrays(st_b)
    pen = penalty_entries(st_b, V)
    K = max_logprobs(st_b)
    tokens = np.zeros(9, np.int64)
    lp = np.zeros((9, 1 + K), np.float32)
    ids = np.zeros((9, 1 + K), np.int64)
    sample_on_device(kt, logits.copy(), params, uniforms, (pen[0], pen[1], len(pen[0])), K, tokens, lp, ids)
    # the plain-temperature row (1) takes the device's one-pass Gumbel-max, keyed by the same
    # uniform (kernels/reference.py sample_gumbel), every other row the NumPy sampler's path
    plain = np.array([c.keys() == {"temperature"} and c["temperature"] > 0 for c in cases])
    assert plain.tolist() == [False, True] + [False] * 7
    np.testing.assert_array_equal(tokens[~plain], want.token_ids[~plain])
    check_gumbel_picks(tokens[plain], logits[plain], params[plain, 0], uniforms[plain].view(np.uint64))
    assert tokens[7] not in (2, 7) and tokens[8] not in (2, 5, 7)  # row 7 has no stop token 5
    np.testing.assert_array_equal(ids[:, 1:], want.logprob_token_ids[:, 1:])
    np.testing.assert_array_equal(ids[:, 0], tokens)
    # both are float32 log-softmaxes of the same float32 logits (NumPy's, the sampling kernel's)
    raw = log_softmax(logits.astype(np.float32))
    ref = want.logprobs.copy()
    ref[plain, 0] = raw[plain, tokens[plain]]
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(lp), fin)
    np.testing.assert_array_less(np.abs(lp - ref)[fin], 2 * log_softmax_bound(ref[fin], V))


def test_profile_step_shape_is_the_largest_step():
    # all of max_num_batched_tokens (not min(budget, max_model_len)), over as many sequences as
    # may run, none longer than max_model_len
    assert profile_step_shape(64, 8, 40) == [8] * 8
    assert profile_step_shape(64, 2, 40) == [32, 32]
    assert profile_step_shape(200, 2, 40) == [40, 40]
    assert profile_step_shape(16384, 256, 2048) == [64] * 256
    assert profile_step_shape(16384, 4, 2048) == [2048] * 4
    assert gpu_kv_budget(1000, 300, 500, 400, 100, 0.9) == 900 - 200 - 300


def test_kv_sizing_profiles_the_real_step_shape_and_counts_the_pool_peak(modules, tmp_path, monkeypatch):
    # a fake device of 256 MiB with 30 MiB outside the pool: the profiling step runs all 128
    # tokens of the budget as 8 sequences sampling 8 rows (not min(128, max_model_len) tokens of
    # one sequence), and the budget takes the pool's peak in use, not the blocks the pool keeps
    # cached after the step (which the old rule, total - free, counted as used)
    fx = FakeXP()
    dev = FakeMemoryDevice(fx, total_bytes=1 << 28, context_bytes=30 << 20)
    table = make_table(modules, dev, xp=fx)
    seen = []
    real_embedding = cuda_ops.CudaKernels.embedding
    monkeypatch.setattr(cuda_ops.CudaKernels, "embedding",
                        lambda self, ids, t, out=None: seen.append(ids.shape[0]) or real_embedding(self, ids, t, out=out))
    budgets = []

    def spy(*args):
        budgets.append(args)
        return gpu_kv_budget(*args)

    monkeypatch.setattr(sys.modules["folio.runtime.worker.model_runner"], "gpu_kv_budget", spy)
    runner = make_runner(monkeypatch, table, model_dir(tmp_path), max_num_seqs=8, max_model_len=100,
                         max_num_batched_tokens=128, num_kv_blocks_override=None, gpu_memory_utilization=0.5)
    assert seen[0] == 128
    (total, free, held, peak, kv, util), = budgets
    assert total == 1 << 28 and total - free - held == 30 << 20  # outside the pool: the context only
    assert held > peak - kv  # the pool keeps the step's freed temporaries cached ...
    budget = gpu_kv_budget(total, free, held, peak, kv, util)
    assert budget > int(util * total - (total - free) + kv)  # ... the old rule would have lost them
    assert runner.num_blocks == min(budget // runner.bytes_per_block, max_useful_blocks(8, 100, BS))
    runner.shutdown()


def test_kv_sizing_counts_the_gemm_workspace(modules, tmp_path, monkeypatch):
    # cuBLAS's workspace (kernels/cuda/cublas.py) comes from the pool when the table is built, so it
    # is in the pool's bytes in use throughout the profiling step: a GEMM holding W more bytes of
    # workspace leaves the KV cache exactly W fewer bytes (all else equal: same steps, same pool)
    from simt.table import numpy_gemm

    budgets = {}
    for ws_bytes in (0, 8 << 20):
        fx = FakeXP()
        dev = FakeMemoryDevice(fx, total_bytes=1 << 28, context_bytes=30 << 20)

        class Gemm:
            workspace = fx.empty(ws_bytes, np.uint8)

            def __call__(self, xb, w, out):
                numpy_gemm(xb, w, out)

        table = cuda_ops.CudaKernels(fx, lambda n: modules[n].get_function(n), gemm=Gemm(), smem_limit=227 * 1024,
                                     device=dev, kernel_names=cuda_sources.all_kernel_names())
        seen = []
        monkeypatch.setattr(sys.modules["folio.runtime.worker.model_runner"], "gpu_kv_budget",
                            lambda *a: seen.append(gpu_kv_budget(*a)) or seen[-1])
        runner = make_runner(monkeypatch, table, model_dir(tmp_path), max_num_seqs=4, max_model_len=64,
                             max_num_batched_tokens=32, num_kv_blocks_override=None, gpu_memory_utilization=0.5)
        budgets[ws_bytes] = seen[0]
        runner.shutdown()
    assert budgets[0] - budgets[8 << 20] == 8 << 20, budgets


def test_setup_work_is_waited_for_before_steps_on_the_step_stream(modules, tmp_path, monkeypatch):
    # setup (weights, RoPE table, KV cache zeros) runs on the legacy default stream, steps on a
    # non-blocking stream that does not wait for it: a device-wide sync must come before the
    # profiling step's first launch, and end the runner's setup (after the KV cache is made)
    dev = CountingDevice()
    runner = make_runner(monkeypatch, make_table(modules, dev), model_dir(tmp_path), num_kv_blocks_override=None)
    first = dev.order.index("launch")
    assert "device_sync" in dev.order[:first], dev.order[:first + 1]
    assert dev.order[-1] == "device_sync", dev.order[-3:]
    runner.shutdown()


def test_device_dummy_weights_membership_does_not_generate(modules, monkeypatch):
    from folio.model.config import ModelConfig
    from folio.model.loader import _DeviceDummyWeights

    made = []
    fake = SimpleNamespace(random_weight=lambda shape, **kw: made.append(shape) or np.zeros(shape, np.uint16))
    w = _DeviceDummyWeights(ModelConfig.from_dict(TINY), fake)
    assert "model.norm.weight" in w and "nope" not in w
    assert made == []
    w["model.norm.weight"]
    assert made == [(64,)]


def test_auto_falls_back_to_cpu_when_kernels_fail_to_build(monkeypatch):
    # a CuPy whose GPU is there but whose kernel compilation fails: the table build raises (all
    # kernels are compiled then), so --device auto picks the CPU before any forward pass
    class CompileException(Exception):
        pass

    class FakeModule:
        def __init__(self, code, options=()):
            self.code = code

        def get_function(self, name):
            raise CompileException(f"nvrtc: error in {name}")

    fake = SimpleNamespace(
        cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=lambda: 1),
                             Device=lambda: SimpleNamespace(compute_capability="90",
                                                            attributes={"MaxSharedMemoryPerBlockOptin": 232448})),
        RawModule=FakeModule)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cuda_ops, "_TABLE", None)
    from folio.kernels import get_kernels
    from folio.model.loader import resolve_device

    with pytest.raises(RuntimeError, match="kernels failed to build.*CompileException: nvrtc: error in"):
        get_kernels("cuda")
    assert resolve_device("auto") == "cpu"


def test_placeholder_inputs_on_the_device_path(modules, tmp_path, monkeypatch):
    # overlap scheduling hands over decode plans whose inputs are placeholders for the tokens the
    # step before sampled; on the CUDA table (graphs on) the runner fills them in before the upload:
    # the same tokens and logprobs as plans carrying the ids
    from folio.runtime.common.step import PLACEHOLDER_TOKEN_ID
    results = {}
    for placeholders in (False, True):
        runner = make_runner(monkeypatch, make_table(modules, CountingDevice()), model_dir(tmp_path))
        seqs = _seqs(PARAMS)
        steps = run_steps(runner, seqs, n_decode=0)
        got = [steps[-1][0].sampled_token_ids.tolist()]
        for k in range(3):
            plan = plan_for(20 + k, seqs)
            if placeholders:
                plan.input_ids[:] = PLACEHOLDER_TOKEN_ID
            res = runner.execute(plan)
            assert res.error is None, res.error
            got.append(res.sampled_token_ids.tolist())
            for sq, t in zip(seqs, res.sampled_token_ids.tolist()):
                sq.tokens.append(t)
        results[placeholders] = got
        runner.shutdown()
    assert results[True] == results[False]


def test_graph_batch_buckets_are_multiples_of_8():
    from folio.runtime.worker.device_step import graph_batch_bucket, graph_batch_sizes

    assert graph_batch_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(3) == [1, 2, 3]
    for m in (1, 3, 8, 12, 100, 256):  # each batch goes to the smallest size that holds it
        sizes = graph_batch_sizes(m)
        for n in range(1, m + 1):
            assert graph_batch_bucket(n, m) == min(b for b in sizes if b >= n), (n, m)


def test_decode_graph_of_a_multiple_of_8_bucket_equals_eager(modules, tmp_path, monkeypatch):
    # nine greedy sequences with max_num_seqs 12: the decode graph pads them to 12 rows (a power of
    # two would be 16, above max_num_seqs), and replays give the eager steps' tokens (every
    # product's input is rounded to bf16, so padding rows change no real row's logits: see
    # test_decode_graph_replays_equal_eager_steps)
    tokens = {}
    for eager in (True, False):
        runner = make_runner(monkeypatch, make_table(modules, CountingDevice()), model_dir(tmp_path),
                             enforce_eager=eager, max_num_seqs=12, num_kv_blocks_override=72)
        rng = np.random.default_rng(3)
        seqs = [Seq(i, rng.integers(3, 200, 5 + 3 * i).tolist(), list(range(6 * i, 6 * i + 6)),
                    SamplingParams(temperature=0.0)) for i in range(9)]
        tokens[eager] = [r.sampled_token_ids.tolist() for r, _ in run_steps(runner, seqs, n_decode=2)]
        if not eager:
            assert runner.device_step.graph_error is None
            assert set(runner.device_step.graphs) == {(12, 1)}
        runner.shutdown()
    assert tokens[True] == tokens[False]
