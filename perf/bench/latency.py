"""Single-stream prefill and decode rates: one request at a time, folio and llama-server alike.

A user running a model on a CPU for themselves sends one request and waits: what counts is how
fast the prompt is read (prefill) and how fast tokens come after that (decode). Each engine gets
the same request ``num_iters`` times after ``num_iters_warmup`` untimed runs (the first faults a
memory-mapped model in and, for folio, loads the compiled kernels):

* a prompt of ``input_len`` random token ids (``common.random_requests``, fixed seed) and exactly
  ``output_len`` greedy tokens (``ignore_eos``), nothing cached between iterations (folio: a fresh
  engine per iteration with prefix caching off; llama-server: ``cache_prompt: false``);
* **TTFT** runs from the request's start to its first sampled token: the whole prompt's forward
  pass (one step: the token budget holds the prompt) plus sampling. **Prefill tok/s** =
  ``input_len / TTFT``; **decode tok/s** = ``(output_len - 1) / (last token - first token)``, the
  forward passes of one token each. llama-server's figures are its own ``timings`` of the request
  (``prompt_ms``, ``predicted_ms``: the same two intervals, llama.cpp
  ``tools/server/server-common.h``); folio's are the step driver's clock (``common.run_trace``),
  in this process, with no HTTP in between;
* the median iteration is reported;
* **peak RSS**: the engine process's ``VmHWM`` at the end (folio: this process; llama-server:
  the server), memory-mapped weights that were touched included;
* **greedy agreement**: the tokens both engines generated from the same prompt agree for the first
  ``k`` of ``output_len``: a figure (quantized arithmetic differs between engines), not a test.

Shaped like vLLM's ``vllm bench latency`` (``--input-len``, ``--output-len``, ``--num-iters``,
``--num-iters-warmup``), with batch size 1 and the two phases split, as llama.cpp's
``llama-bench`` does (pp / tg).
"""

from __future__ import annotations

import statistics

from .common import ModelHost, command_line, ignore_eos_params, machine_info, random_requests, run_trace


def _median(iters: list[dict]) -> dict:
    return {k: statistics.median(it[k] for it in iters) for k in ("ttft_s", "decode_s", "prefill_tok_s",
                                                                     "decode_tok_s")}


def run_folio_latency(model: str, prompt_token_ids: list[int], output_len: int, threads: int, num_iters: int,
                      num_iters_warmup: int, **engine_args) -> dict:
    """folio's single-stream figures (see the module docstring).

    Returns:
        dict: iters (per iteration: ttft_s, decode_s, prefill_tok_s, decode_tok_s, output_tokens),
        token_ids (the last iteration's output), load_s, warm_up_s, peak_rss_bytes, threads.
    Raises:
        what loading ``model`` raises (``throughput.LOAD_ERRORS`` where folio refuses it).
    """
    from folio.kernels.cpu.threads import numba_threads
    from folio.runtime.common.config import cdiv

    from .common import BenchRequest
    from .llama_server import peak_rss_bytes
    n = len(prompt_token_ids) + output_len
    host = ModelHost(model, max_model_len=max(n, 2048), num_blocks=cdiv(n, 16) + 16, **engine_args)
    with numba_threads(threads):
        host.warm_up()
    req = BenchRequest(prompt_token_ids, output_len)
    iters, token_ids = [], []
    for i in range(num_iters_warmup + num_iters):
        engine = host.engine(max_num_seqs=1, max_num_batched_tokens=max(2048, len(prompt_token_ids)),
                             enable_prefix_caching=False)
        with numba_threads(threads):
            res = run_trace(engine, [req], ignore_eos_params)
        times = res.token_times["0"]
        if len(times) != output_len:
            raise RuntimeError(f"folio produced {len(times)} tokens, asked {output_len}")
        token_ids = list(res.outputs["0"].outputs[0].token_ids)
        if i >= num_iters_warmup:
            ttft, dec = times[0] - res.arrivals["0"], times[-1] - times[0]
            iters.append({"ttft_s": ttft, "decode_s": dec, "output_tokens": len(times),
                          "prefill_tok_s": len(prompt_token_ids) / ttft, "decode_tok_s": (len(times) - 1) / dec})
    return {"iters": iters, "token_ids": token_ids, "load_s": host.load_s, "warm_up_s": host.warm_up_s,
            "peak_rss_bytes": peak_rss_bytes(), "threads": threads,
            "activation_quantization": host.runner.model.activation_quantization}


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens of ``a`` and ``b`` are the same."""
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k


def run_latency(model: str = "smollm2-135m-instruct", *, input_len: int = 512, output_len: int = 128,
                num_iters: int = 3, num_iters_warmup: int = 1, seed: int = 0, peers=(), threads: int | None = None,
                build_llama_server: bool = True, run_folio: bool = True, **engine_args) -> dict:
    """folio's, then each peer's single-stream figures on ``model``.

    Args:
        model: a folio model name, Hugging Face folder or GGUF file; llama-cpp-server runs on a GGUF
            file as is, else on the model's packaged GGUF as F32 and as shipped
            (``llama_server.peer_files``).
        peers: ``("llama-cpp-server",)`` or none.
        run_folio: False runs only the peers; folio is also skipped, with the loader's message,
            when it refuses ``model``.
        engine_args: folio's other ``EngineConfig`` fields (``dtype``, ``activation_quantization``).
    Returns:
        dict: command, model, workload, folio (figures: median and iters; or ``{"skipped": why}``),
        peers (key -> figures, with ``agreement``: leading greedy tokens equal to folio's), machine.
    Raises:
        ValueError: ``output_len < 2`` or an unknown peer.
    """
    from folio.kernels.cpu.threads import num_threads

    from . import llama_server
    from .throughput import LOAD_ERRORS
    if output_len < 2:
        raise ValueError("--output-len must be >= 2 (decode is timed from the first token to the last)")
    unknown = set(peers) - {"llama-cpp-server"}
    if unknown:
        raise ValueError(f"single-stream peers: llama-cpp-server only, got {sorted(unknown)}")
    threads = threads or num_threads()
    prompt = random_requests(1, (input_len, input_len), (output_len, output_len), seed)[0].prompt_token_ids
    folio = {"skipped": "not run (--no-folio)"}
    if run_folio:
        try:
            folio = run_folio_latency(model, prompt, output_len, threads, num_iters, num_iters_warmup, **engine_args)
            folio["median"] = _median(folio["iters"])
        except LOAD_ERRORS as e:
            folio = {"skipped": f"folio cannot serve {model}: {e}"}
    out = {"command": command_line(), "model": str(model),
           "workload": {"input_len": input_len, "output_len": output_len, "num_iters": num_iters,
                        "num_iters_warmup": num_iters_warmup, "seed": seed, "prompts": "random token ids",
                        "ignore_eos": True},
           "threads": threads, "folio": folio, "peers": {}, "machine": machine_info()}
    if "llama-cpp-server" in peers:
        why = llama_server.peer_ready(build_llama_server)
        try:
            runs = llama_server.peer_files(model) if why is None else []
        except (RuntimeError, ValueError, OSError) as e:
            why, runs = str(e), []
        if why is not None:
            out["peers"]["llama-cpp-server"] = {"skipped": why}
        for quant, path in runs:
            key, label = f"llama-cpp-server-{quant.lower()}", f"llama-server {quant}"
            try:
                r = llama_server.run_llama_server_latency(path, prompt, output_len, threads, num_iters,
                                                          num_iters_warmup)
            except (RuntimeError, OSError) as e:
                out["peers"][key] = {"label": label, "skipped": str(e)}
                continue
            r["median"] = _median(r["iters"])
            if "token_ids" in folio and r.get("token_ids") is not None:
                r["agreement"] = agreement(folio["token_ids"], r["token_ids"])
            out["peers"][key] = {"label": label, **r}
    return out


def format_latency(out: dict) -> str:
    """Human-readable lines of ``run_latency``'s result."""
    from .throughput import gb
    w, m = out["workload"], out["machine"]
    lines = [
        f"command: {out['command']}",
        f"model: {out['model']}",
        f"workload: one request at a time, {w['input_len']} prompt tokens ({w['prompts']}, seed {w['seed']}), "
        f"{w['output_len']} output tokens (greedy, ignore_eos); median of {w['num_iters']} timed iterations "
        f"after {w['num_iters_warmup']} warm-up",
        f"machine: {m.get('cpu', '?')}, {m.get('cores')} cores, load {m.get('loadavg_1m', 0):.1f}; "
        f"threads per engine: {out['threads']}"
        + (f"; folio's activations: {out['folio']['activation_quantization']}"
           if "activation_quantization" in out["folio"] else ""),
        "",
        f"{'engine':<24}{'prefill tok/s':>15}{'decode tok/s':>14}{'TTFT s':>9}{'peak RSS GB':>13}{'agreement':>11}",
    ]

    def row(label: str, p: dict) -> str:
        if "skipped" in p:
            return f"{label:<24}  skipped: {p['skipped']}"
        md = p["median"]
        agree = f"{p['agreement']}/{w['output_len']}" if "agreement" in p else ""
        return (f"{label:<24}{md['prefill_tok_s']:>15.1f}{md['decode_tok_s']:>14.2f}{md['ttft_s']:>9.3f}"
                f"{gb(p.get('peak_rss_bytes')):>13}{agree:>11}")

    lines.append(row("folio", out["folio"]))
    for key, p in out["peers"].items():
        lines.append(row(p.get("label", key), p))
    f = out["folio"]
    for key, p in out["peers"].items():
        if "skipped" not in p and "skipped" not in f:
            a, b = f["median"], p["median"]
            lines.append(f"folio / {p['label']}: prefill {a['prefill_tok_s'] / b['prefill_tok_s']:.2f}x, "
                         f"decode {a['decode_tok_s'] / b['decode_tok_s']:.2f}x")
    for key, p in out["peers"].items():
        if p.get("command"):
            lines.append(f"{p.get('label', key)}: {p['command']}")
    if any("agreement" in p for p in out["peers"].values()):
        lines.append("agreement: the leading greedy tokens both engines generated alike (a figure, not a test)")
    return "\n".join(lines)
