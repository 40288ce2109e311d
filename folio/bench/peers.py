"""The peers of the throughput comparison, run on the same workload in the same process.

- Hugging Face transformers ``generate`` in static batches of 16, left-padded (how its users batch
  offline), float32 on CPU, greedy; ``min_new_tokens = max_new_tokens`` plays ``ignore_eos``. A
  batch runs until its longest request is done; only the tokens each request asked for count as
  output (the rest is the padding cost of static batching).
- llama.cpp through llama-cpp-python on the same model's GGUF file (Q4_1 weights, as packaged),
  one request at a time as its Python API serves them, greedy, stopped after exactly the asked
  number of tokens.

Both are optional (``pip install 'folio-serve[perf]'``); ``available(name)`` says whether one can
run and why not.
"""

from __future__ import annotations

import importlib.util
import time

from .common import BenchRequest

PEERS = ("transformers", "llama-cpp")


def available(name: str) -> tuple[bool, str]:
    """(whether peer ``name`` can run here, the reason when not)."""
    mods = {"transformers": ("torch", "transformers"), "llama-cpp": ("llama_cpp",)}[name]
    missing = [m for m in mods if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"{', '.join(missing)} not installed (pip install 'folio-serve[perf]')"
    return True, ""


def run_transformers(model_dir, requests: list[BenchRequest], batch_size: int = 16, threads: int = 1,
                     progress=None) -> dict:
    """Run ``requests`` through ``AutoModelForCausalLM.generate`` in static batches.

    Returns:
        dict: wall_s, requests, output_tokens (asked for), generated_tokens (incl. the tokens a
        short request spends waiting for its batch), prompt_tokens, load_s, batch_size, threads,
        versions.
    Raises:
        RuntimeError: torch/transformers missing.
    """
    ok, why = available("transformers")
    if not ok:
        raise RuntimeError(why)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    generated = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch_size):
            batch = requests[b:b + batch_size]
            L = max(len(r.prompt_token_ids) for r in batch)
            ids = torch.full((len(batch), L), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), L), dtype=torch.long)
            for i, r in enumerate(batch):  # left padding
                n = len(r.prompt_token_ids)
                ids[i, L - n:] = torch.tensor(r.prompt_token_ids)
                mask[i, L - n:] = 1
            new = max(r.output_len for r in batch)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
            generated += (out.shape[1] - L) * len(batch)
            if progress is not None:
                progress.update(len(batch))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "requests": len(requests), "output_tokens": sum(r.output_len for r in requests),
            "generated_tokens": generated, "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "load_s": load_s, "batch_size": batch_size, "threads": threads,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def run_llama_cpp(gguf_path, requests: list[BenchRequest], threads: int = 1, progress=None) -> dict:
    """Run ``requests`` one at a time through ``llama_cpp.Llama.generate`` (greedy).

    Returns:
        dict: wall_s, requests, output_tokens, prompt_tokens, load_s, threads, gguf, versions.
    Raises:
        RuntimeError: llama_cpp missing.
    """
    ok, why = available("llama-cpp")
    if not ok:
        raise RuntimeError(why)
    import llama_cpp

    n_ctx = max(len(r.prompt_token_ids) + r.output_len for r in requests) + 8
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)
    load_s = time.perf_counter() - t0
    produced = 0
    start = time.perf_counter()
    for r in requests:
        n = 0
        for _tok in llm.generate(r.prompt_token_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                 repeat_penalty=1.0, reset=True):
            n += 1
            if n >= r.output_len:
                break
        produced += n
        if progress is not None:
            progress.update(1)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "requests": len(requests), "output_tokens": produced,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "load_s": load_s,
            "threads": threads, "gguf": str(gguf_path), "versions": {"llama_cpp_python": llama_cpp.__version__}}
