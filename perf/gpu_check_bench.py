"""Throughput benchmark for perf/gpu_check.sh: folio or Hugging Face transformers, one workload.

The workload is nano-vllm's bench.py shape: ``--num-requests`` requests (default 256) of random
prompt token ids, input and output lengths each uniform in [100, 1024], ``ignore_eos`` (every
request produces exactly its output length), temperature 0.6. The same seed gives the same
workload to both engines. Throughput = output tokens / wall seconds of the generate call (a short
warm-up runs first and is not timed); total tokens/s (prompt + output) is reported too.

Models: a folio model name or Hugging Face Llama folder, or one of the dummy-weight configs below
(``llama-3.1-8b-dummy``, ``smollm2-135m-dummy``): a config.json is written to a temp folder and
weights are random (folio: ``load_format="dummy"``; transformers: ``from_config`` on the GPU).

Both engines get the whole workload and the same concurrency: folio ``--max-num-seqs`` running
sequences, Hugging Face static batches of as many requests (``--hf-batch`` overrides; left-padded
prompts, generation until the batch's longest requested output, min_new_tokens =
max_new_tokens so EOS never stops it; only each request's requested tokens count as output).
folio's warm-up captures every CUDA-graph bucket the run can meet (``graph_buckets``), so none is
captured in the timed region (the result counts any that were). Hugging Face's timed region
starts after torch's import, the model's load and a warm-up; ``--step-limit`` (the limit the
process runs under) or ``--time-budget`` stops its generation early through a StoppingCriteria,
and the result then says ``"partial": true`` (tokens produced so far / time: not comparable).

Usage: python perf/gpu_check_bench.py --engine folio|hf --model M --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

PROCESS_START = time.perf_counter()  # before torch's import (hf): --step-limit counts from here
STEP_MARGIN_S = 5.0                  # left of --step-limit for writing the result and exiting

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "rope_scaling": None, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}
# smollm2-2l-dummy: two layers and a 2048-token vocabulary, for perf/gpu_check.sh's dry run (emulator)
DUMMY = {"llama-3.1-8b-dummy": LLAMA_31_8B, "smollm2-135m-dummy": SMOLLM2_135M,
         "smollm2-2l-dummy": dict(SMOLLM2_135M, num_hidden_layers=2, vocab_size=2048)}


def workload(num_requests: int, seed: int, vocab: int, min_len: int = 100, max_len: int = 1024):
    """``[(prompt_ids, max_tokens)]``: lengths uniform in [min_len, max_len], ids uniform in
    [0, 10000)."""
    rng = np.random.default_rng(seed)
    hi = min(vocab, 10000)
    out = []
    for _ in range(num_requests):
        n_in, n_out = int(rng.integers(min_len, max_len + 1)), int(rng.integers(min_len, max_len + 1))
        out.append((rng.integers(0, hi, n_in).tolist(), n_out))
    return out


def synthetic_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer.json with exactly ``vocab_size`` ids ("t0", "t1", ...), so a dummy
    model needs no tokenizer files from anywhere (benchmarks pass token ids; output text is
    only decoded, never compared)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 131072}, f)


def model_dir_for(model: str) -> tuple[str, bool, dict]:
    """(path, dummy?, config dict). A dummy config gets a temp folder with its config.json and a
    synthetic tokenizer."""
    if model in DUMMY:
        d = tempfile.mkdtemp(prefix=f"folio-{model}-")
        cfg = DUMMY[model]
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        synthetic_tokenizer(d, cfg["vocab_size"])
        return d, True, cfg
    if os.path.isdir(model):
        path = model
    else:
        from folio.model.registry import resolve_model

        path = str(resolve_model(model))
    with open(os.path.join(path, "config.json")) as f:
        return path, False, json.load(f)


def graph_buckets(max_num_seqs: int, max_context: int, partition: int = 512) -> list[tuple[int, int]]:
    """The CUDA-graph keys ``(batch bucket, partition bucket)`` a run whose sequences reach at
    most ``max_context`` tokens can meet (runtime/worker/device_step.py: batches padded to the next
    of ``graph_batch_sizes(max_num_seqs)``, contexts to a power of two of 512-token partitions)."""
    from folio.runtime.worker.device_step import graph_batch_sizes

    p_top = 1 << max(0, (-(-max_context // partition) - 1).bit_length())
    return [(b, 1 << j) for b in graph_batch_sizes(max_num_seqs) for j in range(p_top.bit_length())]


def _device_step(llm):
    ex = llm.llm_engine.executor
    return getattr(getattr(ex, "runner", ex), "device_step", None)  # in-process executors wrap the ModelRunner


def warm_up_folio(llm, max_num_seqs: int, max_context: int) -> list:
    """Compile / capture everything the timed run can meet: for every graph key ``(B, P)``, ``B``
    requests whose prompts put their first decode step in partition bucket ``P`` (one decode
    step of ``B`` sequences captures that graph). Returns the keys captured."""
    from folio import SamplingParams

    for B, P in graph_buckets(max_num_seqs, max_context):
        n = max(4, (P // 2) * 512 + 1 if P > 1 else 4)  # context n + 1 needs P partitions
        llm.generate([{"prompt_token_ids": [1 + (i + j) % 97 for j in range(n)]} for i in range(min(B, max_num_seqs))],
                     SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), use_tqdm=False)
    step = _device_step(llm)
    return sorted(step.graphs) if step is not None else []


def run_folio(path, dummy, cfg, reqs, args):
    from folio import LLM, SamplingParams

    t0 = time.perf_counter()
    max_context = max(len(ids) + n for ids, n in reqs)
    llm = LLM(model=path, device=args.device, load_format="dummy" if dummy else "auto",
              max_model_len=max(args.max_len * 2, 64), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warmed = warm_up_folio(llm, args.max_num_seqs, max_context)  # kernels, cuBLAS, every graph bucket
    warm_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n, seed=i)
              for i, (_, n) in enumerate(reqs)]
    step = _device_step(llm)
    captures = (lambda: len(step.graphs)) if step is not None else (lambda: 0)
    before = captures()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    captured_in_timed_run = captures() - before
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    expected = sum(n for _, n in reqs)
    metrics = {}
    try:
        metrics = {k: v for k, v in llm.get_metrics().items() if isinstance(v, (int, float))}
    except Exception:
        pass
    return {"load_seconds": round(load_s, 2), "warm_up_seconds": round(warm_s, 2), "elapsed_seconds": round(elapsed, 3),
            "output_tokens": produced, "expected_output_tokens": expected, "partial": False,
            "concurrency": args.max_num_seqs, "graph_buckets_warmed": [list(k) for k in warmed],
            "graphs_captured_in_timed_run": captured_in_timed_run,
            "graph_error": step.graph_error if step is not None else None, "engine_metrics": metrics}


def run_hf(path, dummy, cfg, reqs, args):
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    import_s = time.perf_counter() - PROCESS_START  # torch + transformers, outside the timed region
    t0 = time.perf_counter()
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    if dummy:
        hf_cfg = AutoConfig.from_pretrained(path)  # the config.json written for folio, read the HF way
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(hf_cfg, **{dtype_kw: torch.bfloat16})
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **{dtype_kw: torch.bfloat16}).cuda()
    model.eval()
    load_s = time.perf_counter() - t0
    pad = 0
    deadline = [None]

    class Budget(StoppingCriteria):
        def __call__(self, ids, scores, **kw):
            stop = deadline[0] is not None and time.perf_counter() > deadline[0]
            return torch.full((ids.shape[0],), stop, dtype=torch.bool, device=ids.device)

    def batch_tensors(batch):
        max_in = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), max_in), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), max_in), dtype=torch.long)
        for i, (ids, _) in enumerate(batch):  # left padding
            input_ids[i, max_in - len(ids):] = torch.tensor(ids)
            mask[i, max_in - len(ids):] = 1
        return input_ids.cuda(), mask.cuda(), max_in

    with torch.no_grad():
        ids, mask, _ = batch_tensors(reqs[:2])
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=pad)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        budget = args.time_budget or None
        if args.step_limit:  # what the step's limit leaves after the import, the load and the warm-up
            left = args.step_limit - (t0 - PROCESS_START) - STEP_MARGIN_S
            budget = min(budget, left) if budget else left
        deadline[0] = t0 + budget if budget else None
        produced, partial, done = 0, False, 0
        batch_size = args.hf_batch or args.max_num_seqs
        for b0 in range(0, len(reqs), batch_size):
            batch = reqs[b0:b0 + batch_size]
            ids, mask, max_in = batch_tensors(batch)
            max_out = max(m for _, m in batch)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=max_out, min_new_tokens=max_out,
                                 do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=pad,
                                 stopping_criteria=StoppingCriteriaList([Budget()]))
            made = out.shape[1] - max_in
            produced += sum(min(m, made) for _, m in batch)
            done += len(batch)
            if made < max_out or (deadline[0] is not None and time.perf_counter() > deadline[0]):
                partial = made < max_out or done < len(reqs)
                break
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"import_seconds": round(import_s, 2), "load_seconds": round(load_s, 2), "elapsed_seconds": round(elapsed, 3),
            "output_tokens": produced, "expected_output_tokens": sum(m for _, m in reqs),
            "partial": partial, "requests_started": done, "concurrency": batch_size,
            "time_budget_seconds": round(budget, 2) if budget else None,
            "transformers": transformers.__version__, "torch": torch.__version__}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=("folio", "hf"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--device", default="cuda", help="folio: cuda (cpu for a smoke test of this script)")
    p.add_argument("--time-budget", type=float, default=0.0, help="hf: stop generating after S seconds")
    p.add_argument("--step-limit", type=float, default=0.0,
                   help="hf: the time limit this process runs under (from its start, torch's import "
                        "included): generation stops in time to write the result")
    p.add_argument("--hf-batch", type=int, default=0,
                   help="hf: requests per static batch (default: --max-num-seqs, folio's concurrency)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {"engine": args.engine, "model": args.model, "num_requests": args.num_requests, "seed": args.seed,
              "lengths": [args.min_len, args.max_len]}
    path = dummy = None
    try:
        path, dummy, cfg = model_dir_for(args.model)
        reqs = workload(args.num_requests, args.seed, cfg["vocab_size"], args.min_len, args.max_len)
        result["input_tokens"] = sum(len(ids) for ids, _ in reqs)
        run = run_folio if args.engine == "folio" else run_hf
        result.update(run(path, dummy, cfg, reqs, args))
        s = result["elapsed_seconds"]
        result["output_tokens_per_s"] = round(result["output_tokens"] / s, 1)
        if not result["partial"]:
            result["total_tokens_per_s"] = round((result["output_tokens"] + result["input_tokens"]) / s, 1)
        result["ok"] = True
    except Exception as e:  # recorded, so the other steps of gpu_check.sh still report
        import traceback

        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if dummy:          # model_dir_for's temporary folder (config.json + synthetic tokenizer)
            shutil.rmtree(path, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "traceback"}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
