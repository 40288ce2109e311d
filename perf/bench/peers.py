"""The peers of the throughput comparison, run on the same workload in the same process.

- Hugging Face transformers ``generate`` in static batches of 16, left-padded (how its users batch
  offline), float32 on CPU, greedy; ``min_new_tokens = max_new_tokens`` plays ``ignore_eos``. A
  batch runs until its longest request is done; only the tokens each request asked for count as
  output (the rest is the padding cost of static batching).
- llama.cpp through llama-cpp-python on the same model's GGUF file (Q4_1 weights, as packaged),
  one request at a time as its Python API serves them, greedy, stopped after exactly the asked
  number of tokens.
- llama.cpp's own server (``llama-server``) with one slot per running request and continuous
  batching, on the GGUF as F32 and as shipped (``llama_server.py``; driven over HTTP).

The first two are optional Python packages (``pip install 'folio-serve[perf]'``), the third is
built by ``perf/llama.cpp/Makefile``; ``available(name)`` says whether one can run and why not. Every
peer runs on the thread count folio runs on.
"""

from __future__ import annotations

import importlib.util
import time

from .common import BenchRequest, peer_env

PEERS = ("transformers", "llama-cpp", "llama-cpp-server")  # the last: see llama_server.py


def available(name: str) -> tuple[bool, str]:
    """(whether peer ``name`` can run here, the reason when not)."""
    if name == "llama-cpp-server":
        from .llama_server import available as server_available
        return server_available()
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


def run_isolated(name: str, spec: dict, timeout: float | None = None) -> dict:
    """Run peer ``name`` on the workload ``spec`` in a child process (``python -m perf.bench.peers``).

    A peer that crashes the interpreter (a llama.cpp build using instructions the CPU or VM does not
    allow dies with SIGILL) then costs only its own figures. ``spec``: num_prompts, input_len,
    output_len, seed, model_dir, gguf, batch_size, threads, progress.
    Returns:
        the peer's figures, or ``{"skipped": reason}`` when the child failed.
    """
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        cmd = [sys.executable, "-m", "perf.bench.peers", name, json.dumps(spec), f.name]
        try:
            # with progress bars the child's stderr is live (its errors appear above the report's)
            p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=None if spec.get("progress") else subprocess.PIPE,
                               text=True, timeout=timeout, env=peer_env(spec["threads"]))
        except subprocess.TimeoutExpired:
            return {"skipped": f"timed out after {timeout} s"}
        if p.returncode != 0:
            import signal
            how = (f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0
                   else f"exit code {p.returncode}")
            tail = " ".join((p.stderr or "").strip().splitlines()[-2:])[-300:]
            return {"skipped": f"the {name} peer failed ({how}) {tail}".strip()}
        return json.loads(open(f.name).read())


def _main(argv) -> int:
    import json

    from .common import random_requests
    name, spec, out = argv[0], json.loads(argv[1]), argv[2]
    reqs = random_requests(spec["num_prompts"], tuple(spec["input_len"]), tuple(spec["output_len"]), spec["seed"])
    bar = None
    if spec.get("progress"):
        from tqdm.auto import tqdm
        bar = tqdm(total=len(reqs), desc=name, dynamic_ncols=True)
    if name == "transformers":
        r = run_transformers(spec["model_dir"], reqs, batch_size=spec["batch_size"], threads=spec["threads"],
                             progress=bar)
    elif name == "llama-cpp":
        r = run_llama_cpp(spec["gguf"], reqs, threads=spec["threads"], progress=bar)
    else:
        raise SystemExit(f"unknown peer {name!r}")
    with open(out, "w") as f:
        json.dump(r, f)
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(_main(sys.argv[1:]))
