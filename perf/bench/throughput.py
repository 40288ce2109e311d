"""Offline throughput: one batch of requests through folio (and optionally its peers, same run).

The workload (issue 3, section 7): ``num_prompts`` requests, prompt lengths uniform in
``input_len``, output lengths uniform in ``output_len``, ``ignore_eos``, random token ids from a
fixed seed. Reported like vLLM's ``benchmarks/benchmark_throughput.py``: requests/s, output
tokens/s and total (prompt + output) tokens/s over the wall time of the run, plus the KV cache's
token slots holding K/V versus the slots of the blocks in use (PagedAttention's waste), sampled
after every engine step.
"""

from __future__ import annotations

from .common import (BusyProcesses, ModelHost, TraceResult, command_line, ignore_eos_params, machine_info,
                     random_requests, run_trace)
from . import peers as peers_mod


def folio_figures(res: TraceResult, requests) -> dict:
    prompt = sum(len(r.prompt_token_ids) for r in requests)
    out = res.output_tokens()
    wall = res.wall_s
    held = [k[1] for k in res.kv]
    alloc = [k[2] for k in res.kv]
    peak = max(range(len(res.kv)), key=lambda i: alloc[i]) if res.kv else None
    return {
        "wall_s": wall, "requests": len(requests), "prompt_tokens": prompt, "output_tokens": out,
        "requests_per_s": len(requests) / wall, "output_tokens_per_s": out / wall,
        "total_tokens_per_s": (prompt + out) / wall, "num_steps": res.num_steps,
        "kv_waste_mean": res.kv_waste(),
        "kv_tokens_held_at_peak": held[peak] if peak is not None else 0,
        "kv_tokens_allocated_at_peak": alloc[peak] if peak is not None else 0,
        "peak_blocks_in_use": max((k[4] for k in res.kv), default=0),
        "num_preemptions": res.metrics.get("num_preemptions", 0),
        "num_total_blocks": res.metrics.get("num_total_blocks"),
        "forward_time_s": res.metrics.get("forward_time"),
        "decode_only_forward_time_s": res.metrics.get("decode_only_forward_time"),
        "num_decode_only_steps": res.metrics.get("num_decode_only_steps"),
    }


def peer_figures(r: dict) -> dict:
    wall = r["wall_s"]
    return {**r, "requests_per_s": r["requests"] / wall, "output_tokens_per_s": r["output_tokens"] / wall,
            "total_tokens_per_s": (r["prompt_tokens"] + r["output_tokens"]) / wall}


def load_host(model: str, requests, num_blocks: int | None = None, kv_cache_dtype: str = "auto",
              **engine_args) -> ModelHost:
    """A ``ModelHost`` of ``model`` with a KV cache for every request of ``requests`` at once
    (``num_blocks`` overrides) and a context for the longest (at least 2048); ``engine_args``:
    folio's other ``EngineConfig`` fields (``dtype``, ``activation_quantization``)."""
    from folio.runtime.common.config import cdiv
    need = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    nb = num_blocks or sum(cdiv(len(r.prompt_token_ids) + r.output_len, 16) for r in requests) + 16
    return ModelHost(model, max_model_len=max(need, 2048), num_blocks=nb, kv_cache_dtype=kv_cache_dtype,
                     **engine_args)


# What loading a model folio cannot serve raises (an unsupported file or tensor type, a missing
# file); the run then goes on with the peers, folio recorded as skipped with the message.
LOAD_ERRORS = (ValueError, FileNotFoundError, NotImplementedError, OSError)


def run_throughput(host: ModelHost | None = None, *, model: str = "smollm2-135m-instruct",
                   num_prompts: int = 64, input_len=(32, 512), output_len=(16, 256), seed: int = 0,
                   max_num_seqs: int = 256, max_num_batched_tokens: int = 2048, num_blocks: int | None = None,
                   peers=(), threads: int | None = None, tf_batch_size: int = 16, progress: bool = True,
                   keep_trace: bool = False, build_llama_server: bool = True, busy: int = 0,
                   run_folio: bool = True, kv_cache_dtype: str = "auto", **engine_args) -> dict:
    """Run the workload through folio, then through each peer in ``peers``.

    Args:
        host: an already loaded ``ModelHost`` (None: load one sized for this workload).
        model: a folio model name, a Hugging Face folder or a GGUF file (``FILE.gguf``: folio and
            ``llama-cpp-server`` both run that one file).
        peers: names from ``peers.PEERS``; an unavailable peer is recorded as skipped with its reason.
            ``llama-cpp-server`` runs on a GGUF ``model`` as is, else twice (F32 and the model's
            GGUF as shipped), one slot per request that folio runs at once
            (``min(num_prompts, max_num_seqs)``); with ``build_llama_server`` False it runs only
            when already built.
        run_folio: False runs only the peers (folio recorded as skipped); folio is also skipped,
            with the loader's message, when it refuses ``model`` (``LOAD_ERRORS``).
        busy: processes spinning on a core each during every engine's run (a loaded machine).
        kv_cache_dtype: folio's ``--kv-cache-dtype`` (a host given is used as loaded).
        engine_args: folio's other ``EngineConfig`` fields (``dtype``, ``activation_quantization``;
            a host given is used as loaded).
        threads: the thread count every engine gets (folio's is the calling thread's Numba
            setting; None: that setting, by default every core this process may use).
    Returns:
        dict: workload, folio figures (or ``{"skipped": reason}``), per-peer figures (or
        ``{"skipped": reason}``), machine. Figures include ``peak_rss_bytes``: folio's is this
        process's peak (``VmHWM``) after its run, a server peer's the server process's.
    """
    from tqdm.auto import tqdm

    from folio.kernels.cpu.threads import num_threads, numba_threads
    from .llama_server import peak_rss_bytes
    threads = threads or num_threads()
    requests = random_requests(num_prompts, tuple(input_len), tuple(output_len), seed)
    folio = {"skipped": "not run (--no-folio)"}
    res = None
    if run_folio:
        try:
            if host is None:
                host = load_host(model, requests, num_blocks, kv_cache_dtype, **engine_args)
        except LOAD_ERRORS as e:
            folio = {"skipped": f"folio cannot serve {model}: {e}"}
    if run_folio and host is not None:
        engine = host.engine(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
        bar = tqdm(total=len(requests), desc="folio", disable=not progress, dynamic_ncols=True)
        with numba_threads(threads):
            host.warm_up()  # a cold Numba compile cache compiles here, not inside the timed run
        with numba_threads(threads), BusyProcesses(busy):
            res = run_trace(engine, requests, ignore_eos_params, sample_kv=True, progress=bar)
        bar.close()
        folio = {**folio_figures(res, requests), "peak_rss_bytes": peak_rss_bytes(),
                 "activation_quantization": host.runner.model.activation_quantization}
    out = {
        "command": command_line(),
        "workload": {"num_prompts": num_prompts, "input_len": list(input_len), "output_len": list(output_len),
                     "seed": seed, "prompts": "random token ids", "ignore_eos": True,
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                     "output_tokens": sum(r.output_len for r in requests)},
        "model": str(model),
        "engine": {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
                   "block_size": 16, "num_blocks": host.num_blocks if res is not None else None, "threads": threads,
                   "kv_cache_dtype": kv_cache_dtype, **engine_args},
        "busy_processes": busy,
        "warm_up_s": host.warm_up_s if res is not None else None,
        "folio": folio,
        "peers": {},
        "machine": machine_info(),
    }
    if keep_trace:
        out["_trace"] = res
    for name in peers:
        if name == "llama-cpp-server":
            from .llama_server import run_peer
            with BusyProcesses(busy):
                got = run_peer(model, requests, threads, parallel=min(len(requests), max_num_seqs), progress=progress,
                               build=build_llama_server)
            for key, r in got.items():
                out["peers"][key] = r if "skipped" in r else peer_figures(r)
            continue
        ok, why = peers_mod.available(name)
        if not ok:
            out["peers"][name] = {"skipped": why}
            continue
        spec = {"num_prompts": num_prompts, "input_len": list(input_len), "output_len": list(output_len),
                "seed": seed, "model_dir": str(host.model_dir) if host is not None else None,
                "batch_size": tf_batch_size, "threads": threads, "progress": progress, "gguf": None}
        if name == "transformers" and spec["model_dir"] is None:
            out["peers"][name] = {"skipped": "needs folio's model folder, and folio did not load the model"}
            continue
        if name == "llama-cpp":
            from folio.model.registry import find_packaged_gguf

            from .llama_server import gguf_file
            spec["gguf"] = str(gguf_file(model) or find_packaged_gguf(model))
        with BusyProcesses(busy):
            r = peers_mod.run_isolated(name, spec)
        if "skipped" in r:
            out["peers"][name] = r
            continue
        out["peers"][name] = peer_figures(r)
    return out


def peer_label(name: str, p: dict) -> str:
    """How a peer's row is named in tables (its own ``label``, else by its key)."""
    return p.get("label") or {"transformers": f"transformers (static batches of {p.get('batch_size', 16)})",
                              "llama-cpp": "llama-cpp-python (one at a time)"}.get(name, name)


def gb(nbytes) -> str:
    """Bytes as GB (1e9) with two decimals, or ``?`` when unknown."""
    return f"{nbytes / 1e9:.2f}" if nbytes else "?"


def format_throughput(out: dict) -> str:
    """Human-readable lines of ``run_throughput``'s result."""
    w, f = out["workload"], out["folio"]
    c = max([34] + [len(peer_label(n, p)) + 2 for n, p in out["peers"].items()])  # the engine column
    lines = [
        f"command: {out['command']}",
        *([f"model: {out['model']}"] if out.get("model") else []),
        f"workload: {w['num_prompts']} requests, prompt len uniform {w['input_len']}, output len uniform "
        f"{w['output_len']}, ignore_eos, {w['prompts']}, seed {w['seed']} "
        f"({w['prompt_tokens']} prompt + {w['output_tokens']} output tokens)",
        f"machine: {out['machine'].get('cpu', '?')}, {out['machine'].get('cores')} cores, load "
        f"{out['machine'].get('loadavg_1m', 0):.1f}; threads per engine: {out['engine']['threads']}"
        + (f"; folio's activations: {out['folio']['activation_quantization']}"
           if "activation_quantization" in (out.get("folio") or {}) else "")
        + (f"; folio's sgemm: OpenBLAS {out['machine']['blas_kernels']} kernels" if out["machine"].get("blas_kernels") else "")
        + (f"; {out['busy_processes']} competing busy process(es) during every run" if out.get("busy_processes") else ""),
        *([f"folio warm-up before timing (kernels compiled or loaded from Numba's compile cache): {out['warm_up_s']:.1f} s"]
          if out.get("warm_up_s") is not None else []),
        "",
        f"{'engine':<{c}}{'wall s':>9}{'req/s':>9}{'out tok/s':>11}{'total tok/s':>13}{'peak RSS GB':>13}",
    ]

    def row(label: str, p: dict) -> str:
        if "skipped" in p:
            return f"{label:<{c}}  skipped: {p['skipped']}"
        return (f"{label:<{c}}{p['wall_s']:>9.1f}{p['requests_per_s']:>9.3f}{p['output_tokens_per_s']:>11.1f}"
                f"{p['total_tokens_per_s']:>13.1f}{gb(p.get('peak_rss_bytes')):>13}")

    lines.append(row("folio (continuous batching)", f))
    for name, p in out["peers"].items():
        label = peer_label(name, p)
        lines.append(row(label, p))
        if "skipped" not in p and "skipped" not in f:
            lines.append(f"{'':<{c}}folio / {label}: {f['output_tokens_per_s'] / p['output_tokens_per_s']:.2f}x "
                         "output tokens/s")
    for name, p in out["peers"].items():
        if p.get("command"):
            lines.append(f"{peer_label(name, p)}: {p['command']}")
    if "skipped" in f:
        return "\n".join(lines)
    lines += [
        "",
        f"KV cache: {f['num_total_blocks']} blocks of 16 tokens; peak {f['peak_blocks_in_use']} in use; "
        f"at the peak {f['kv_tokens_held_at_peak']} token slots hold K/V of "
        f"{f['kv_tokens_allocated_at_peak']} allocated; mean waste over all steps "
        f"{100 * f['kv_waste_mean']:.2f}% (target < 4%); preemptions {f['num_preemptions']}",
    ]
    return "\n".join(lines)
