"""Host time of one decode step on the GPU path, measured on the CPU over a device that does nothing.

The worker's whole step (``ModelRunner.execute``: sampling states, input packing, the kernel
table's launch code, CUDA-graph replay or eager launches, the sampler's launches, unpacking the
results) runs on the CUDA table as on a GPU, but the device (``NullDevice``) runs no kernel and
copies nothing, and the GEMM is a no-op: what is left is the host work that a GPU step cannot
overlap today (it runs between one step's sync and the next step's first launch). The model has
Llama-3.1-8B's layer count, heads and vocabulary (32 layers, 32 query and 8 KV heads of 128, 128256
tokens) with narrow widths (the host work does not depend on them): perf/gpu_check.sh's 8B
workload. Requests sample as gpu_check_bench's do (temperature 0.6, a seed each), contexts of
``--context`` tokens.

``--engine`` measures the whole engine instead: ``folio.LLM.generate`` (scheduler, worker,
output processing, detokenizer) over the same null device, ``--seqs`` requests of 32-token
prompts and ``--steps`` output tokens each: wall time per step and the worker's share of it.

Usage: python perf/host_step_time.py [--seqs 64,256] [--steps 50] [--context 300] [--eager] [--engine]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 32, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2}
BLOCK = 16


class _Kernel:
    """A compiled kernel's stand-in: CuPy's calling convention, does nothing."""

    shared_size_bytes = 0
    max_dynamic_shared_size_bytes = 1 << 20

    def __call__(self, grid, block, args, *, shared_mem=0):
        pass


def null_table():
    """The CUDA kernel table over NumPy arrays and a device that runs nothing."""
    from folio.kernels.cuda import table as cuda_ops
    from folio.kernels.cuda.device import HostDevice
    from folio.kernels.cuda.sources import all_kernel_names

    class NullDevice(HostDevice):
        def launch(self, fn, *args, **kwargs):
            if self._capturing is not None:
                self._capturing.calls.append((fn, args, kwargs))

        def h2d(self, dst, src):
            pass

        def d2h(self, dst, src):
            pass

        def pinned_empty(self, nbytes):  # zeros: every "sampled" token is id 0
            return np.zeros(int(nbytes), dtype=np.uint8)

    kernel = _Kernel()
    return cuda_ops.CudaKernels(np, lambda name: kernel, gemm=lambda x, w, out: None, smem_limit=227 * 1024,
                                device=NullDevice(), kernel_names=all_kernel_names())


def decode_plan(step_id, seq_ids, contexts, max_blocks, new=()):
    """A decode ``StepPlan``: one token per sequence, sequence i on blocks ``i * max_blocks ...``."""
    from folio.runtime.common.step import StepPlan

    S = len(seq_ids)
    pos = np.asarray(contexts, np.int64) - 1
    table = (np.arange(S, dtype=np.int32)[:, None] * max_blocks + np.arange(max_blocks, dtype=np.int32))
    slots = table[np.arange(S), pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK
    return StepPlan(step_id=step_id, input_ids=np.full(S, 7, np.int64), positions=pos, slot_mapping=slots,
                    query_start_loc=np.arange(S + 1, dtype=np.int32), seq_lens=np.asarray(contexts, np.int32),
                    block_tables=table, seq_ids=np.asarray(seq_ids, np.int64),
                    logits_indices=np.arange(S, dtype=np.int64), sample_seq_ids=np.asarray(seq_ids, np.int64),
                    new_seqs=list(new))


def measure(S: int, steps: int, context: int, eager: bool, profile=None) -> dict:
    """Host seconds of ``steps`` decode steps of ``S`` sequences (after 3 that capture the graph);
    ``profile``: a ``cProfile.Profile`` enabled around the measured steps only."""
    from folio.kernels.cuda import table as cuda_ops
    from folio.runtime.common.config import EngineConfig
    from folio.runtime.common.sampling_params import SamplingParams
    from folio.runtime.common.step import NewSequence
    from folio.runtime.worker.model_runner import ModelRunner

    d = tempfile.mkdtemp(prefix="folio-host-step-")
    (pathlib.Path(d) / "config.json").write_text(json.dumps(CONFIG))
    max_len = context + steps + 8
    max_blocks = -(-max_len // BLOCK)
    cuda_ops._TABLE = null_table()
    try:
        runner = ModelRunner(EngineConfig(model=d, device="cuda", load_format="dummy", block_size=BLOCK,
                                          max_num_seqs=S, max_num_batched_tokens=max(S, 2048),
                                          max_model_len=max_len, num_kv_blocks_override=S * max_blocks + 1,
                                          enforce_eager=eager))
        new = [NewSequence(i, [5] * (context - 1), [], SamplingParams(temperature=0.6, max_tokens=10 ** 6,
                                                                     ignore_eos=True, seed=i).to_dict(), i, [2])
               for i in range(S)]
        seq_ids = list(range(S))
        contexts = [context] * S
        times = []
        for k in range(steps + 3):  # the first steps capture the graph
            plan = decode_plan(k, seq_ids, contexts, max_blocks, new if k == 0 else ())
            if profile is not None and k >= 3:
                profile.enable()
            t0 = time.perf_counter()
            res = runner.execute(plan)
            times.append(time.perf_counter() - t0)
            if profile is not None:
                profile.disable()
            assert res.error is None, res.error
            contexts = [c + 1 for c in contexts]
        runner.shutdown()
    finally:
        cuda_ops._TABLE = None
    t = times[3:]
    return {"seqs": S, "mode": "eager" if eager else "graphs", "median_ms": 1e3 * statistics.median(t),
            "mean_ms": 1e3 * statistics.fmean(t), "min_ms": 1e3 * min(t), "steps": len(t)}


def measure_engine(S: int, steps: int) -> dict:
    """Wall seconds per step of ``LLM.generate`` over the null device (module docstring)."""
    sys.path.insert(0, str(ROOT / "perf"))
    from gpu_check_bench import synthetic_tokenizer

    from folio import LLM, SamplingParams
    from folio.kernels.cuda import table as cuda_ops

    d = tempfile.mkdtemp(prefix="folio-host-engine-")
    (pathlib.Path(d) / "config.json").write_text(json.dumps(CONFIG))
    synthetic_tokenizer(d, CONFIG["vocab_size"])
    cuda_ops._TABLE = null_table()
    try:
        llm = LLM(model=d, device="cuda", load_format="dummy", max_model_len=64 + steps, max_num_seqs=S,
                  max_num_batched_tokens=max(2048, 32 * S), num_kv_blocks_override=S * (-(-(64 + steps) // BLOCK)) + 1,
                  block_size=BLOCK)
        prompts = [{"prompt_token_ids": [3 + (i + j) % 97 for j in range(32)]} for i in range(S)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps, seed=i) for i in range(S)]
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up: captures a graph or two
        before = dict(llm.get_metrics())
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        m = llm.get_metrics()
    finally:
        cuda_ops._TABLE = None
    n = m["num_steps"] - before["num_steps"]
    busy = m["worker_busy_time"] - before["worker_busy_time"]
    return {"seqs": S, "steps": n, "wall_ms_per_step": 1e3 * wall / n, "worker_ms_per_step": 1e3 * busy / n}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", default="64,256")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--eager", action="store_true", help="also without CUDA graphs (every launch from Python)")
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions of the measured steps")
    p.add_argument("--engine", action="store_true", help="the whole engine's generate (module docstring)")
    args = p.parse_args(argv)
    print("python perf/host_step_time.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"CPU: {cpu_model()}; Python {platform.python_version()}, NumPy {np.__version__}")
    for S in [int(s) for s in args.seqs.split(",")]:
        if args.engine:
            r = measure_engine(S, args.steps)
            print(f"{S:4d} requests, engine: {r['wall_ms_per_step']:.3f} ms of wall time per step, of which the "
                  f"worker's forward + sample {r['worker_ms_per_step']:.3f} ms ({r['steps']} steps)")
            continue
        for eager in ((False, True) if args.eager else (False,)):
            prof = None
            if args.profile:
                import cProfile

                prof = cProfile.Profile()
            r = measure(S, args.steps, args.context, eager, prof)
            print(f"{r['seqs']:4d} sequences, {r['mode']:6s}: host time per decode step median {r['median_ms']:.3f} ms, "
                  f"mean {r['mean_ms']:.3f}, min {r['min_ms']:.3f} ({r['steps']} steps)")
            if prof is not None:
                import pstats

                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
