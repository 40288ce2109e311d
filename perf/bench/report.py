"""``folio bench report``: the seven measurements of the perf report, its plots and REPORT.md.

Writes into ``out_dir`` (default ``perf/``): ``REPORT.md``, ``report.json`` (every raw figure) and
PNG plots (``fig*.png``). Each section of REPORT.md gives the claim, the setup, the figure, what
it means (worded from the measured numbers) and the command that reproduces it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import llama_server
from .common import ModelHost, command_line, machine_info, random_requests
from .throughput import peer_label

SECTIONS = (1, 2, 3, 4, 5, 6, 7)


@dataclass
class ReportSize:
    """Workload sizes of every section (``full()``: the report; ``tiny()``: the tests)."""

    max_model_len: int = 4096
    num_blocks: int = 2560
    # 1 (trace replay, no model) and 3 (throughput)
    s1_num_requests: int = 400
    s1_rate_per_step: float = 2.0
    s1_num_blocks: int = 1024
    s1_max_model_len: int = 2048
    s3_num_prompts: int = 64
    s3_input_len: tuple = (32, 512)
    s3_output_len: tuple = (16, 256)
    s3_peers: tuple = ("transformers", "llama-cpp", "llama-cpp-server")
    s3_threads: tuple = (1, 0)          # thread counts of section 3 (0: --threads, every core by default)
    s3_peers_one_thread: tuple = ("transformers", "llama-cpp-server")  # the 1-thread pass (time)
    s3_build_llama_server: bool = True  # build llama-server (perf/llama.cpp/Makefile) when missing
    s3_kernel_layers: int = 30          # kernel rates (folio bench kernels) beside the throughput
    s3_kernel_contexts: tuple = (128, 512, 2048)
    s3_kernel_repeat: int = 5
    s3_kernel_model_decode: bool = True
    # 2
    s2_num_requests: int = 20
    s2_input_len: tuple = (32, 128)
    s2_output_len: tuple = (16, 96)
    s2_rates: tuple = (1.0, 2.0, 4.0)
    s2_max_num_seqs: int = 8
    # 4
    s4_num_prompts: int = 2
    s4_prompt_len: int = 512
    s4_output_len: int = 32
    s4_n: tuple = (2, 4, 8)
    s4_beam_widths: tuple = (2, 4, 8)
    # 5
    s5_system_len: int = 1500
    s5_num_questions: int = 32
    s5_question_len: tuple = (12, 32)
    s5_output_len: int = 8
    s5_change_positions: tuple = (0, 375, 750, 1125, 1499)
    # 6
    s6_num_streams: int = 16
    s6_stream_input_len: tuple = (32, 96)
    s6_stream_output_len: int = 40
    s6_long_len: int = 3000
    s6_long_output_len: int = 4
    s6_inject_after: int = 4
    s6_budgets: tuple = (256, 512, 2048)

    @classmethod
    def full(cls) -> "ReportSize":
        return cls()

    @classmethod
    def tiny(cls) -> "ReportSize":
        return cls(max_model_len=512, num_blocks=160, s1_num_requests=40, s1_num_blocks=64, s1_max_model_len=256,
                   s3_num_prompts=4, s3_input_len=(8, 24), s3_output_len=(2, 6), s3_build_llama_server=False,
                   s3_kernel_layers=2, s3_kernel_contexts=(128,), s3_kernel_repeat=1, s3_kernel_model_decode=False,
                   s2_num_requests=4, s2_input_len=(8, 16), s2_output_len=(2, 4), s2_rates=(20.0, 80.0),
                   s2_max_num_seqs=2, s4_num_prompts=1, s4_prompt_len=40, s4_output_len=3, s4_n=(2, 4), s4_beam_widths=(2,),
                   s5_system_len=64, s5_num_questions=3, s5_question_len=(3, 6), s5_output_len=2,
                   s5_change_positions=(0, 40, 63), s6_num_streams=2, s6_stream_input_len=(4, 8),
                   s6_stream_output_len=8, s6_long_len=200, s6_long_output_len=2, s6_inject_after=2,
                   s6_budgets=(32, 64))


def _section_command(n: int, size_name: str) -> str:
    extra = " --tiny" if size_name == "tiny" else ""
    return f"folio bench report --sections {n}{extra}"


def run_report(out_dir="perf", sections=SECTIONS, size: ReportSize | None = None, size_name: str = "full",
               model: str = "smollm2-135m-instruct", threads: int = 1, progress: bool = True,
               plots: bool = True, update: bool = False) -> dict:
    """Run ``sections``, write report.json, the plots and REPORT.md into ``out_dir``.

    Args:
        update: keep the other sections of the existing ``out_dir/report.json`` and replace only
            those run now (the report then says which sections were rerun, when and how).
    Returns:
        the raw figures (also in ``out_dir/report.json``).
    Raises:
        FileNotFoundError: ``update`` without an existing report.json.
    """
    if update:
        return _update_report(out_dir, sections, size, size_name, model, threads, progress, plots)
    from tqdm.auto import tqdm

    from .kv_replay import run_section1
    from .sections import run_section2, run_section4, run_section5, run_section6, run_section7
    from .throughput import run_throughput

    size = size or ReportSize.full()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # section 3 (the peers) last: the model-only sections are done even if a peer is slow or fails
    sections = sorted(set(int(s) for s in sections), key=lambda s: (s == 3, s))
    t_start = time.perf_counter()
    data: dict = {"command": command_line(), "size": size_name, "sizes": asdict(size), "threads": threads,
                  "machine_start": machine_info(), "sections": {}, "timings_s": {},
                  "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    bar = tqdm(total=len(sections), desc="report sections", dynamic_ncols=True, disable=not progress)
    host = None
    if any(s in (2, 3, 4, 5, 6) for s in sections):
        host = ModelHost(model, max_model_len=size.max_model_len, num_blocks=size.num_blocks)
        data["model_load_s"] = host.load_s
        data["warm_up_s"] = host.warm_up()  # kernels compiled before any section's clock starts
    for s in sections:
        bar.set_postfix_str(f"section {s}")
        t0 = time.perf_counter()
        sub = tqdm(desc=f"  section {s}", dynamic_ncols=True, disable=not progress, leave=False)
        if s == 1:
            data["sections"]["1"] = _section1(size, model, host)
        elif s == 2:
            sub.total = len(size.s2_rates) * 2
            data["sections"]["2"] = run_section2(host, size, sub)
        elif s == 3:
            data["sections"]["3"] = _section3(size, model, host, threads, progress)
        elif s == 4:
            sub.total = len(size.s4_n) + len(size.s4_beam_widths)
            data["sections"]["4"] = run_section4(host, size, sub)
        elif s == 5:
            sub.total = 3
            data["sections"]["5"] = run_section5(host, size, sub)
        elif s == 6:
            sub.total = len(size.s6_budgets) + 1
            data["sections"]["6"] = run_section6(host, size, sub)
        elif s == 7:
            from folio.model.registry import resolve_model
            data["sections"]["7"] = run_section7(resolve_model(model))
        sub.close()
        data["timings_s"][str(s)] = time.perf_counter() - t0
        bar.update(1)
    bar.close()
    data["total_s"] = time.perf_counter() - t_start
    data["machine_end"] = machine_info()
    if "1" in data["sections"] and "3" in data["sections"]:
        data["consistency"] = _consistency(data)
    figs = make_plots(data, out_dir) if plots else {}
    (out_dir / "report.json").write_text(json.dumps(_jsonable(data), indent=1))
    (out_dir / "REPORT.md").write_text(render_markdown(data, figs, size_name))
    return data


def _update_report(out_dir, sections, size, size_name, model, threads, progress, plots) -> dict:
    """``run_report(update=True)``: rerun ``sections`` into a scratch folder, then merge them into
    the existing report.json (sizes of the rerun sections recorded with them) and re-render."""
    import tempfile
    out_dir = Path(out_dir)
    data = json.loads((out_dir / "report.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        new = run_report(tmp, sections, size, size_name, model, threads, progress, plots=False)
    for k, v in new["sections"].items():
        data["sections"][k] = v
        data["timings_s"][k] = new["timings_s"][k]
    data.setdefault("reruns", []).append({"sections": sorted(new["sections"], key=int), "command": new["command"],
                                          "started": new["started"], "size": size_name, "threads": threads,
                                          "machine_start": new["machine_start"], "machine_end": new["machine_end"],
                                          "total_s": new["total_s"]})
    (out_dir / "report.json").write_text(json.dumps(_jsonable(data), indent=1))
    return rerender(out_dir) if plots else data


def rerender(out_dir="perf") -> dict:
    """Redraw the plots and rewrite REPORT.md from ``out_dir/report.json`` (no measurement)."""
    out_dir = Path(out_dir)
    data = json.loads((out_dir / "report.json").read_text())
    figs = make_plots(data, out_dir)
    (out_dir / "REPORT.md").write_text(render_markdown(data, figs, data.get("size", "full")))
    return data


def _section1(size: ReportSize, model: str, host) -> dict:
    """Two traces: a Poisson trace that fills the memory, and section 3's offline workload in
    section 3's KV cache (to check its waste against the block pool's counters in section 3)."""
    from folio.model.config import ModelConfig
    from folio.model.registry import resolve_model
    from folio.model.tokenizer import Tokenizer
    from .kv_replay import run_section1

    mdir = resolve_model(model)
    mc = ModelConfig.from_pretrained(mdir)
    tok = host.tokenizer if host is not None and host.tokenizer is not None else Tokenizer.from_pretrained(mdir)
    reqs = random_requests(size.s1_num_requests, size.s3_input_len, size.s3_output_len, seed=1)
    rng = np.random.default_rng(11)
    t = np.cumsum(rng.exponential(1.0 / size.s1_rate_per_step, len(reqs)))
    for r, a in zip(reqs, t):
        r.arrival = float(a)
    poisson = run_section1(reqs, size.s1_num_blocks, 16, size.s1_max_model_len, mc, tok)
    s3reqs = random_requests(size.s3_num_prompts, size.s3_input_len, size.s3_output_len, seed=0)
    offline = run_section1(s3reqs, size.num_blocks, 16, size.max_model_len, mc, tok)
    return {"poisson": {"num_requests": len(reqs), "rate_per_step": size.s1_rate_per_step,
                        "num_blocks": size.s1_num_blocks, "max_model_len": size.s1_max_model_len, **poisson},
            "section3_workload": {"num_requests": len(s3reqs), "num_blocks": size.num_blocks,
                                  "max_model_len": size.max_model_len, **offline}}


def _section3(size: ReportSize, model: str, host, threads: int, progress: bool) -> dict:
    """The throughput workload through folio and its peers at each of ``size.s3_threads`` (the
    largest first: its run carries the KV trace; the others run only ``s3_peers_one_thread``:
    llama-cpp-python one request at a time on one thread would add ~6 minutes), then the kernel
    rates at the same counts."""
    from .kernel_rates import run_kernel_rates
    from .throughput import run_throughput

    counts = sorted({t or threads for t in size.s3_threads}, reverse=True)
    runs = []
    for i, t in enumerate(counts):
        peers = size.s3_peers if i == 0 else tuple(p for p in size.s3_peers if p in size.s3_peers_one_thread)
        runs.append(run_throughput(host, model=model, num_prompts=size.s3_num_prompts, input_len=size.s3_input_len,
                                   output_len=size.s3_output_len, seed=0, peers=peers, threads=t,
                                   progress=progress, keep_trace=i == 0,
                                   build_llama_server=size.s3_build_llama_server))
    main = runs[0]
    trace = main.pop("_trace")
    main["kv_trace"] = [list(k) for k in trace.kv]
    main["other_threads"] = [{k: r[k] for k in ("engine", "folio", "peers", "machine")} for r in runs[1:]]
    main["kernel_rates"] = run_kernel_rates(counts[::-1], repeat=size.s3_kernel_repeat, layers=size.s3_kernel_layers,
                                            contexts=size.s3_kernel_contexts,
                                            model=model if size.s3_kernel_model_decode else None)
    return main


def _consistency(data) -> dict:
    s1 = data["sections"]["1"]["section3_workload"]["summary"]["paged (folio block pool)"]
    s3 = data["sections"]["3"]["folio"]
    return {"section1_replay_waste": s1["waste"], "section3_measured_waste": s3["kv_waste_mean"],
            "section1_replay_steps": s1["num_steps"], "section3_steps": s3["num_steps"],
            "match": abs(s1["waste"] - s3["kv_waste_mean"]) < 1e-9 and s1["num_steps"] == s3["num_steps"]}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


# ---------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------
def make_plots(data: dict, out_dir: Path) -> dict:
    """One or more PNGs per section present; returns ``{key: file name}``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    S = data["sections"]

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        figs[name.split("_")[0]] = name

    if "1" in S:
        runs = S["1"]["poisson"]["runs"]
        cap = S["1"]["poisson"]["capacity_tokens"]
        fig, ax = plt.subplots(figsize=(7, 3.4))
        for name, r in runs.items():
            res = np.asarray(r["reserved"], float)
            frac = np.divide(np.asarray(r["held"], float), res, out=np.full_like(res, np.nan), where=res > 0)
            ax.plot(frac, label=name, lw=1)
        ax.set_xlabel("engine step")
        ax.set_ylabel("KV slots holding tokens /\nslots reserved")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"KV memory holding real tokens ({cap} slots)")
        ax.legend(fontsize=8)
        save(fig, "fig1a_kv_used_fraction.png")
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for name, r in runs.items():
            ax.plot(r["running"], label=name, lw=1)
        ax.set_xlabel("engine step")
        ax.set_ylabel("requests running")
        ax.set_title("batch size the same KV memory allows")
        ax.legend(fontsize=8)
        save(fig, "fig1b_batch_size.png")
    if "2" in S:
        rows = S["2"]["rows"]
        fig, axs = plt.subplots(1, 3, figsize=(10, 3.2))
        for pol, style in (("continuous", "o-"), ("static", "s--")):
            rr = [r for r in rows if r["policy"] == pol]
            x = [r["rate"] for r in rr]
            axs[0].plot(x, [r["throughput_tok_s"] for r in rr], style, label=pol)
            axs[1].plot(x, [r["latency_mean_s"] for r in rr], style, label=pol)
            axs[2].plot(x, [r["latency_p99_s"] for r in rr], style, label=pol)
        for ax, t in zip(axs, ("output tokens/s", "mean latency (s)", "P99 latency (s)")):
            ax.set_xlabel("request rate (req/s)")
            ax.set_title(t)
            ax.legend(fontsize=8)
        save(fig, "fig2_continuous_vs_static.png")
    if "3" in S:
        runs = _s3_runs(S["3"])
        names = ["folio"] + [k for k in runs[0]["peers"] if "skipped" not in runs[0]["peers"][k]]
        fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names) + 1), 3.4))
        width = 0.8 / len(runs)
        for i, r in enumerate(runs):
            vals = [r["folio"]["output_tokens_per_s"] if n == "folio" else
                    r["peers"].get(n, {}).get("output_tokens_per_s", 0.0) for n in names]
            bars = ax.bar(np.arange(len(names)) + (i - (len(runs) - 1) / 2) * width, vals, width,
                          label=f"{r['engine']['threads']} thread(s)")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(np.arange(len(names)), [_s3_label(n, runs[0]["peers"].get(n, {})).replace(" (", "\n(")
                                              for n in names], fontsize=7)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{S['3']['workload']['num_prompts']} requests, same run")
        ax.legend(fontsize=8)
        save(fig, "fig3_throughput_peers.png")
    if "4" in S:
        rows = S["4"]["rows"]
        x = np.arange(len(rows))
        fig, axs = plt.subplots(1, 2, figsize=(9, 3.2))
        axs[0].bar(x - 0.2, [r["shared"]["peak_blocks"] for r in rows], 0.4, label="shared + copy-on-write")
        axs[0].bar(x + 0.2, [r["separate"]["peak_blocks"] for r in rows], 0.4, label="n separate requests")
        axs[0].set_xticks(x, [f"n={r['n']}" for r in rows])
        axs[0].set_ylabel("peak KV blocks in use")
        axs[0].legend(fontsize=8)
        axs[1].bar(x - 0.2, [r["shared"]["output_tokens"] / r["shared"]["wall_s"] for r in rows], 0.4, label="shared")
        axs[1].bar(x + 0.2, [r["separate"]["output_tokens"] / r["separate"]["wall_s"] for r in rows], 0.4,
                   label="separate")
        axs[1].set_xticks(x, [f"n={r['n']}" for r in rows])
        axs[1].set_ylabel("output tokens/s")
        axs[1].legend(fontsize=8)
        save(fig, "fig4_parallel_sampling.png")
        beams = S["4"].get("beam_rows")
        if beams:
            x = np.arange(len(beams))
            fig, ax = plt.subplots(figsize=(5, 3.2))
            ax.bar(x - 0.2, [r["shared"]["peak_blocks"] for r in beams], 0.4, label="beams sharing blocks")
            ax.bar(x + 0.2, [r["separate"]["peak_blocks"] for r in beams], 0.4, label="beams as separate sequences")
            ax.set_xticks(x, [f"width {r['beam_width']}" for r in beams])
            ax.set_ylabel("peak KV blocks in use")
            ax.legend(fontsize=8)
            save(fig, "fig4b_beam_search.png")
    if "5" in S:
        r = S["5"]
        fig, axs = plt.subplots(1, 2, figsize=(9, 3.2))
        axs[0].plot(sorted(r["off"]["ttfts"]), "s--", ms=3, label="caching off")
        axs[0].plot(sorted(r["on"]["ttfts"]), "o-", ms=3, label="caching on")
        axs[0].set_xlabel("request (sorted by TTFT)")
        axs[0].set_ylabel("TTFT (s)")
        axs[0].legend(fontsize=8)
        ch = r["changed_token"]
        axs[1].plot([c["position"] for c in ch], [c["cached_tokens"] for c in ch], "o-", label="cached tokens")
        axs[1].set_xlabel("position of the one changed system-prompt token")
        axs[1].set_ylabel("prompt tokens served from the prefix cache")
        ax2 = axs[1].twinx()
        ax2.plot([c["position"] for c in ch], [c["ttft_s"] for c in ch], "r^--", label="TTFT")
        ax2.set_ylabel("TTFT (s)", color="r")
        save(fig, "fig5_prefix_caching.png")
    if "6" in S:
        rows = S["6"]["rows"]
        labels = [str(r["budget"]) for r in rows]
        x = np.arange(len(rows))
        fig, axs = plt.subplots(1, 2, figsize=(9, 3.2))
        axs[0].bar(x - 0.2, [r["itl_median_s"] * 1e3 for r in rows], 0.4, label="median")
        axs[0].bar(x + 0.2, [r["itl_p99_s"] * 1e3 for r in rows], 0.4, label="P99")
        axs[0].set_xticks(x, labels)
        axs[0].set_xlabel("token budget per step")
        axs[0].set_ylabel("streams' inter-token latency (ms)")
        axs[0].legend(fontsize=8)
        axs[1].bar(x, [r["long_ttft_s"] for r in rows], color="C2")
        axs[1].set_xticks(x, labels)
        axs[1].set_xlabel("token budget per step")
        axs[1].set_ylabel(f"TTFT of the {S['6']['long_len']}-token prompt (s)")
        save(fig, "fig6_chunked_prefill.png")
    if "7" in S:
        rows = S["7"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.barh([r["model"] for r in rows], [r["kv_bytes_per_token_bf16"] / 1024 for r in rows])
        for i, r in enumerate(rows):
            ax.text(r["kv_bytes_per_token_bf16"] / 1024, i, f" {r['kv_bytes_per_token_bf16'] / 1024:.1f} KiB",
                    va="center", fontsize=8)
        ax.set_xlabel("KV bytes per token, bf16 (KiB)")
        save(fig, "fig7_kv_sizing.png")
    return figs


# ---------------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------------
def _s3_runs(r: dict) -> list[dict]:
    """Section 3's runs, the largest thread count first (older report.json files have one)."""
    return [r] + list(r.get("other_threads", []))


def _server_build_text(server: dict | None) -> str:
    level = (server or {}).get("isa")
    if level == "$FOLIO_LLAMA_CPP_BIN":
        return "(the user's binaries from `$FOLIO_LLAMA_CPP_BIN`)"
    return ("built from the source in the pinned llama-cpp-python sdist (`perf/llama.cpp/Makefile`"
            + (f", {llama_server.ISA_NAMES.get(level, level)} build" if level else "") + ")")


def _s3_label(name: str, p: dict) -> str:
    return "folio (continuous batching)" if name == "folio" else peer_label(name, p)


def _section3_markdown(r: dict, figure: list, reproduce: str) -> list:
    runs = _s3_runs(r)
    w = r["workload"]
    server = next((p for run in runs for p in run["peers"].values() if "parallel" in p), None)
    L = ["## 3. Throughput against peers", "",
         "**Claim** (vLLM, Kwon et al. 2023): up to 24x the throughput of Hugging Face Transformers; here also "
         "against the engine a CPU user would pick, llama.cpp's own server with continuous batching.", "",
         f"**Setup**: {w['num_prompts']} requests, prompt lengths uniform {w['input_len']}, output lengths uniform "
         f"{w['output_len']}, ignore_eos, {w['prompts']} (seed {w['seed']}). folio: continuous batching, budget "
         "2048 tokens/step, float32. transformers: `generate` in static batches of 16, left-padded, float32. "
         "llama-cpp-python: the packaged Q4_1 GGUF, one request at a time. llama-server: llama.cpp's HTTP server "
         + _server_build_text(server) + ", "
         + (f"{server['parallel']} slots (one per request folio runs at once), a KV stream per slot (its "
            "default; one buffer shared by all slots, `--kv-unified`, was 1.6x slower here), continuous "
            "batching, " if server else "") +
         "every request sent at once over HTTP; on the same GGUF converted to F32 with llama-quantize (folio's "
         "precision) and as shipped (Q4_1). Every engine runs with the thread count in the table, one after the "
         "other on the same machine.", ""] + figure + [
         "| engine | threads | wall (s) | requests/s | output tokens/s | total tokens/s | folio / engine |",
         "|---|---|---|---|---|---|---|"]
    for run in runs:
        f, t = run["folio"], run["engine"]["threads"]
        L.append(f"| folio | {t} | {f['wall_s']:.1f} | {f['requests_per_s']:.3f} | {f['output_tokens_per_s']:.1f} | "
                 f"{f['total_tokens_per_s']:.1f} | |")
        for name, p in run["peers"].items():
            if "skipped" in p:
                L.append(f"| {_s3_label(name, p)} | {t} | skipped: {p['skipped']} | | | | |")
            else:
                L.append(f"| {_s3_label(name, p)} | {t} | {p['wall_s']:.1f} | {p['requests_per_s']:.3f} | "
                         f"{p['output_tokens_per_s']:.1f} | {p['total_tokens_per_s']:.1f} | "
                         f"{f['output_tokens_per_s'] / p['output_tokens_per_s']:.2f}x |")
    meaning = []
    for run in runs:
        f = run["folio"]
        ratios = [f"{f['output_tokens_per_s'] / p['output_tokens_per_s']:.2f}x {_s3_label(n, p)}"
                  for n, p in run["peers"].items() if "skipped" not in p]
        meaning.append(f"with {run['engine']['threads']} thread(s) folio's output tokens/s are "
                       f"{', '.join(ratios) if ratios else '(no peer ran)'}")
    if len(runs) > 1:
        hi, lo = runs[0], runs[-1]
        meaning.append(f"folio with {hi['engine']['threads']} threads runs {hi['folio']['output_tokens_per_s'] / lo['folio']['output_tokens_per_s']:.2f}x "
                       f"its {lo['engine']['threads']}-thread rate (goal on an idle 2-core machine: >= 1.7x)")
    f = r["folio"]
    loads = ", ".join(f"{run['machine'].get('loadavg_1m', 0):.1f}" for run in runs)
    L += ["", "**Meaning**: " + "; ".join(meaning) + ". " +
          f"1-min load at the end of each run: {loads}. KV cache during the {r['engine']['threads']}-thread run: "
          f"mean waste {_pct(f['kv_waste_mean'])} (held {f['kv_tokens_held_at_peak']} of "
          f"{f['kv_tokens_allocated_at_peak']} allocated slots at the peak, {f['peak_blocks_in_use']} of "
          f"{f['num_total_blocks']} blocks), {f['num_preemptions']} preemptions.", ""]
    if "kernel_rates" in r:
        L += _kernel_rates_markdown(r["kernel_rates"])
    L += [f"Reproduce: `{reproduce}`, or one thread count at a time: `folio bench throughput --peer transformers "
          "--peer llama-cpp --peer llama-cpp-server --threads N` and `folio bench kernels`", ""]
    return L


def _kernel_rates_markdown(k: dict) -> list:
    L = ["### CPU kernel rates against this machine's limits", "",
         "Measured by the code of `folio bench kernels` (perf/bench/kernel_rates.py) right after the throughput "
         f"runs; sgemm = {k['blas']}. Copy bandwidth: every thread `memcpy`s a slice of 512 MiB (read + write bytes). "
         "Decode-sized products stream the default model's per-layer weights (GB/s of weights read); batched "
         "products and prefill attention against BLAS sgemm on its own threads, same shapes (attention: "
         "`[ctx, 576] x [576, 3072]`); decode attention = 16 sequences of one token, GB/s of K/V read; "
         "single-sequence decode against weights bytes per step / copy bandwidth. Read bandwidth: every thread "
         "takes the BLAS `sdot` of slices of two 256 MiB arrays (bytes read), the limit of a stream that only "
         "reads; the second figure in parentheses is the share of it.", "",
         "| threads | load | copy GB/s | read GB/s | product T=1 GB/s (% copy, % read) | T=8 "
         "| batched products % of sgemm (min..max) "
         "| decode attention GB/s (% copy, % read), by context | prefill attention % of sgemm, by context "
         "| 1-sequence decode tok/s (% of DRAM bound: copy, read) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in k["runs"]:
        bw, rb = run["copy_gbs"], run.get("read_gbs")

        def pc(g, bw=bw, rb=rb):
            return f"{100 * g / bw:.0f}%" + (f", {100 * g / rb:.0f}%" if rb else "")
        dp = {d["rows"]: d for d in run["decode_products"]}
        bp = [d["gflops"] / d["sgemm_gflops"] for d in run["batched_products"]]
        dec = ", ".join(f"{d['ctx']}: {d['gbs']:.1f} ({pc(d['gbs'])})" for d in run["attention"]
                        if d["kind"] == "decode")
        pre = ", ".join(f"{d['ctx']}: {100 * d['gflops'] / d['sgemm_gflops']:.0f}%" for d in run["attention"]
                        if d["kind"] == "prefill")
        md = run.get("model_decode")
        mds = (f"{md['decode_tokens_per_s']:.1f} ({100 * md['decode_tokens_per_s'] / md['bound_tokens_per_s']:.0f}%"
               + (f", {100 * md['decode_tokens_per_s'] / md['read_bound_tokens_per_s']:.0f}%"
                  if "read_bound_tokens_per_s" in md else "") + ")" if md else "-")
        t1 = dp.get(1)
        t8 = dp.get(8)
        L.append(f"| {run['threads']} | {run['load_start']:.1f} | {bw:.1f} | "
                 + (f"{rb:.1f}" if rb else "-") + " | "
                 + (f"{t1['gbs']:.1f} ({pc(t1['gbs'])})" if t1 else "-") + " | "
                 + (f"{t8['gbs']:.1f} ({pc(t8['gbs'])})" if t8 else "-") + " | "
                 f"{100 * min(bp):.0f}%..{100 * max(bp):.0f}% | {dec} | {pre} | {mds} |")
    L.append("")
    for run in k["runs"]:   # the same work as phases of one parallel region, as the forward runs it
        bw = run["copy_gbs"]
        dp = [d for d in run["decode_products"] if "gbs_region" in d]
        bp = [d["gflops_region"] / d["sgemm_gflops"] for d in run["batched_products"] if "gflops_region" in d]
        att = [d for d in run["attention"] if "gbs_region" in d or "gflops_region" in d]
        if not (dp or bp or att):
            continue
        parts = []
        if dp:
            parts.append("decode-sized products " + ", ".join(
                f"T={d['rows']} {d['gbs_region']:.1f} GB/s ({100 * d['gbs_region'] / bw:.0f}% of copy)" for d in dp))
        if bp:
            parts.append(f"batched products {100 * min(bp):.0f}%..{100 * max(bp):.0f}% of sgemm")
        dec = [f"{d['ctx']}: {d['gbs_region']:.1f} GB/s ({100 * d['gbs_region'] / bw:.0f}% of copy)" for d in att
               if d["kind"] == "decode"]
        pre = [f"{d['ctx']}: {100 * d['gflops_region'] / d['sgemm_gflops']:.0f}%" for d in att if d["kind"] == "prefill"]
        if dec:
            parts.append("decode attention " + ", ".join(dec))
        if pre:
            parts.append("prefill attention " + ", ".join(pre) + " of sgemm")
        L += [f"With {run['threads']} threads, the same work as phases of one parallel region (as the forward runs "
              f"a step: no thread wake-up per call; an empty region costs {run['region']['median_us']:.0f} us "
              f"median here): " + "; ".join(parts) + ".", ""]
    return L


def _pct(x):
    return f"{100 * x:.1f}%"


def _beam_search_markdown(r: dict, figure: list) -> list:
    rows = r["beam_rows"]
    L = ["### Beam search", "",
         "**Claim** (PagedAttention section 4.4): beam search is where block sharing matters most: beams fork and "
         "die every step, and sharing their common blocks saves up to 55% of KV memory.", "",
         f"**Setup**: the same {r['num_prompts']} prompt(s) of {r['prompt_len']} tokens, beam search of "
         f"{r['output_len']} tokens (ignore_eos) at each width. Sharing: folio's beams, sequences of one request "
         "that fork by reference count (copy-on-write of a shared partly filled block; a beam that falls off frees "
         "its blocks at once). Separate: the same search with every fork copying all of its parent's blocks "
         "(`perf/bench/separate_beams.py`), as if each beam were a sequence of its own; prefix caching off. Peak "
         "blocks in use from the block pool.", ""] + figure + [
         "| beam width | peak blocks sharing | peak blocks separate | memory saved | same beams |",
         "|---|---|---|---|---|"]
    for x in rows:
        L.append(f"| {x['beam_width']} | {x['shared']['peak_blocks']} | {x['separate']['peak_blocks']} | "
                 f"{_pct(x['memory_saving'])} | {'yes' if x['same_results'] else 'NO'} |")
    last = rows[-1]
    L += ["", f"**Meaning**: at width {last['beam_width']} the beams hold {last['shared']['peak_blocks']} blocks at the "
          f"peak instead of {last['separate']['peak_blocks']} ({_pct(last['memory_saving'])} saved): the prompt's "
          "blocks and every prefix the beams still have in common are held once, and a pruned beam's blocks return "
          "at once. How much is saved depends on how much of each beam is shared: here a "
          f"{r['prompt_len']}-token prompt and {r['output_len']} generated tokens per beam (the published 55% is "
          "for its own workloads).", ""]
    return L


def render_markdown(data: dict, figs: dict, size_name: str = "full") -> str:
    S = data["sections"]
    m0 = data["machine_start"]
    L = ["# folio performance report", "",
         f"Generated {data['started']} by `{data['command']}` in {data['total_s'] / 60:.1f} min "
         f"({'tiny test sizes' if size_name == 'tiny' else 'full sizes'}).",
         f"Machine: {m0.get('cpu', '?')}, {m0.get('cores')} cores, {m0.get('mem_total_gib', '?')} GiB"
         + (f", folio's sgemm: OpenBLAS {m0['blas_kernels']} kernels" if m0.get("blas_kernels") else "") + "; 1-min load "
         f"{m0.get('loadavg_1m', 0):.1f} at the start and {data['machine_end'].get('loadavg_1m', 0):.1f} at the end "
         "(the machine is shared, so timings are noisy). Model: SmolLM2-135M-Instruct, float32 on CPU, "
         f"{data['threads']} thread(s) per engine (folio and every peer alike; section 3 also at 1). Raw figures: "
         "[report.json](report.json).", ""]
    for u in data.get("reruns", []):
        L += [f"Section(s) {', '.join(u['sections'])} rerun {u['started']} by `{u['command']}` in "
              f"{u['total_s'] / 60:.1f} min on {u['machine_start'].get('cpu', '?')}, {u['machine_start'].get('cores')} "
              f"cores" + (f" (folio's sgemm: OpenBLAS {u['machine_start']['blas_kernels']} kernels)"
                          if u["machine_start"].get("blas_kernels") else "")
              + f", {u['threads']} thread(s), 1-min load {u['machine_start'].get('loadavg_1m', 0):.1f} at the start "
              f"and {u['machine_end'].get('loadavg_1m', 0):.1f} at the end; the other sections are from the run above.",
              ""]
    cmd = lambda n: _section_command(n, size_name)  # noqa: E731

    def fig(key):
        return [f"![{key}]({figs[key]})", ""] if key in figs else []

    if "1" in S:
        p = S["1"]["poisson"]
        su = p["summary"]
        pg, mx, pm = su["paged (folio block pool)"], su["contiguous, max_model_len"], su["contiguous, prompt+max_tokens"]
        L += ["## 1. KV memory waste", "",
              "**Claim** (PagedAttention, Kwon et al. 2023): reserving contiguous max-length KV space per request "
              "wastes 60-80% of KV memory; paged blocks waste under 4%.", "",
              f"**Setup**: {p['num_requests']} requests (prompt and output lengths as in section 3), Poisson "
              f"arrivals at {p['rate_per_step']} per engine step, replayed in {p['capacity_tokens']} KV token slots "
              f"({p['num_blocks']} blocks of 16) through folio's real scheduler and block pool (no model: a stub "
              "executor returns a token per row, so block bookkeeping is as in a real run), and through two "
              f"simulated contiguous allocators reserving max_model_len = {p['max_model_len']} or prompt + "
              "max_tokens per request.", ""] + fig("fig1a") + fig("fig1b") + [
              "| allocator | KV waste (1 - held/reserved) | mean batch | max batch | steps to finish |",
              "|---|---|---|---|---|"]
        for name, s in su.items():
            L.append(f"| {name} | {_pct(s['waste'])} | {s['batch_size_mean']:.1f} | {s['batch_size_max']} | "
                     f"{s['num_steps']} |")
        L += ["", f"**Meaning**: in the same memory, reserving max_model_len wastes {_pct(mx['waste'])} of the "
              f"reserved KV memory and allows a mean batch of {mx['batch_size_mean']:.1f}; reserving prompt + "
              f"max_tokens wastes {_pct(pm['waste'])} (batch {pm['batch_size_mean']:.1f}); folio's blocks waste "
              f"{_pct(pg['waste'])} (only the unfilled tail of each sequence's last block) and run a mean batch "
              f"of {pg['batch_size_mean']:.1f}, finishing the trace in {pg['num_steps']} steps versus "
              f"{mx['num_steps']}. "
              + ("The published ranges hold here." if mx["waste"] >= 0.6 and pg["waste"] < 0.04 else
                 "Compare with the published ranges above: the measured figures are what this trace gives."), ""]
        o = S["1"]["section3_workload"]["summary"]["paged (folio block pool)"]
        L += [f"Section 3's workload replayed the same way in section 3's cache gives {_pct(o['waste'])} waste in "
              f"{o['num_steps']} steps"]
        if "consistency" in data:
            c = data["consistency"]
            L[-1] += (f"; the block pool's own counters during section 3's real run read "
                      f"{_pct(c['section3_measured_waste'])} in {c['section3_steps']} steps "
                      f"({'identical' if c['match'] else 'NOT identical'}).")
        L += ["", f"Reproduce: `{cmd(1)}`", ""]
    if "2" in S:
        r = S["2"]
        L += ["## 2. Continuous versus static batching", "",
              "**Claim** (Orca, Yu et al. OSDI 2022): request-level batching holds finished requests in the batch "
              "and makes new ones wait; iteration-level scheduling removes both.", "",
              f"**Setup**: the same {r['num_requests']} requests (prompt {r['input_len']}, output {r['output_len']} "
              f"tokens, ignore_eos) with Poisson arrivals at each rate, real engine runs in wall-clock time, "
              f"max_num_seqs {r['max_num_seqs']}; `StaticBatchScheduler` (perf/bench/static_batching.py) admits a new batch only when "
              "the current one has finished.", ""] + fig("fig2") + [
              "| rate (req/s) | policy | output tok/s | mean latency (s) | P99 latency (s) | mean TTFT (s) |",
              "|---|---|---|---|---|---|"]
        for x in r["rows"]:
            L.append(f"| {x['rate']} | {x['policy']} | {x['throughput_tok_s']:.1f} | {x['latency_mean_s']:.2f} | "
                     f"{x['latency_p99_s']:.2f} | {x['ttft_mean_s']:.2f} |")
        per_rate = []
        for rate in r["rates"]:
            c = next(x for x in r["rows"] if x["rate"] == rate and x["policy"] == "continuous")
            s = next(x for x in r["rows"] if x["rate"] == rate and x["policy"] == "static")
            per_rate.append(f"at {rate} req/s continuous gives {c['throughput_tok_s'] / s['throughput_tok_s']:.2f}x "
                            f"static's throughput, mean latency {c['latency_mean_s']:.1f} s vs {s['latency_mean_s']:.1f} s, "
                            f"P99 {c['latency_p99_s']:.1f} s vs {s['latency_p99_s']:.1f} s")
        peak = max(x["throughput_tok_s"] for x in r["rows"])
        demand = min(r["rates"]) * (r["output_len"][0] + r["output_len"][1]) / 2
        sat = (f" The engine served at most {peak:.1f} output tokens/s here while even the lowest rate asks for "
               f"about {demand:.0f}: every rate saturates this machine, queues grow for the whole trace, and "
               "latencies are dominated by queueing; the policies then differ by how full they keep the batch."
               if demand > peak else "")
        L += ["", "**Meaning**: " + "; ".join(per_rate) + "." + sat, "",
              f"Reproduce: `{cmd(2)}`", ""]
    if "3" in S:
        L += _section3_markdown(S["3"], fig("fig3"), cmd(3))
    if "4" in S:
        r = S["4"]
        L += ["## 4. Parallel sampling memory", "",
              "**Claim** (PagedAttention section 4.4): sharing the prompt's blocks among parallel samples (with "
              "copy-on-write) saves up to 55% of KV memory.", "",
              f"**Setup**: {r['num_prompts']} prompt(s) of {r['prompt_len']} tokens, {r['output_len']} output tokens "
              "per sample, temperature 1.0, seed 7. Shared: one request with `n` samples (prompt blocks shared by "
              "reference count). Separate: `n` independent requests with prefix caching off. Peak blocks in use "
              "from the block pool.", ""] + fig("fig4") + [
              "| n | peak blocks shared | peak blocks separate | memory saved | shared/separate tokens/s |",
              "|---|---|---|---|---|"]
        for x in r["rows"]:
            L.append(f"| {x['n']} | {x['shared']['peak_blocks']} | {x['separate']['peak_blocks']} | "
                     f"{_pct(x['memory_saving'])} | {x['speedup']:.2f}x |")
        last = r["rows"][-1]
        L += ["", f"**Meaning**: with n = {last['n']} sharing saves {_pct(last['memory_saving'])} of the KV blocks "
              f"and runs {last['speedup']:.2f}x as fast (the prompt is computed once instead of n times). The "
              "saving grows with n and with the prompt's share of each sequence.", ""]
        if r.get("beam_rows"):
            L += _beam_search_markdown(r, fig("fig4b"))
        L += [f"Reproduce: `{cmd(4)}`", ""]
    if "5" in S:
        r = S["5"]
        on, off = r["on"], r["off"]
        L += ["## 5. Prefix caching", "",
              "**Claim** (vLLM automatic prefix caching; SGLang RadixAttention): requests sharing a long prefix "
              "reuse its KV blocks and skip its prefill.", "",
              f"**Setup**: a {r['system_len']}-token system prompt followed by {r['num_questions']} different short "
              f"questions (random token ids), {r['output_len']} output tokens each, submitted together; prefix "
              "caching off, then on. Then, into the warm prefix cache, the first question again with one token of the "
              "system prompt changed at various positions.", ""] + fig("fig5") + [
              "| prefix caching | total (s) | mean TTFT (s) | median TTFT (s) | hit rate (tokens) |",
              "|---|---|---|---|---|",
              f"| off | {off['total_s']:.2f} | {off['ttft_mean_s']:.2f} | {off['ttft_p50_s']:.2f} | {_pct(off['hit_rate'])} |",
              f"| on | {on['total_s']:.2f} | {on['ttft_mean_s']:.2f} | {on['ttft_p50_s']:.2f} | {_pct(on['hit_rate'])} |",
              "", "| changed token at | cached prompt tokens | expected (whole blocks before it) | TTFT (s) |",
              "|---|---|---|---|"]
        for c in r["changed_token"]:
            L.append(f"| {c['position']} | {c['cached_tokens']} | {c['expected_cached_tokens']} | {c['ttft_s']:.2f} |")
        L.append(f"| (unchanged) | {r['unchanged']['cached_tokens']} | | {r['unchanged']['ttft_s']:.2f} |")
        L += ["", f"**Meaning**: caching cuts the batch's total time {off['total_s'] / on['total_s']:.1f}x and mean TTFT "
              f"{off['ttft_mean_s'] / on['ttft_mean_s']:.1f}x with a {_pct(on['hit_rate'])} token hit rate. A block's "
              "hash chains over every token before it, so one changed token invalidates the cache from its block "
              "on: a change at position 0 loses everything. Put what varies (dates, user names) at the end of the "
              "prompt, never at the start.", "", f"Reproduce: `{cmd(5)}`", ""]
    if "6" in S:
        r = S["6"]
        L += ["## 6. Chunked prefill", "",
              "**Claim** (Sarathi-Serve, Agrawal et al. OSDI 2024; vLLM chunked prefill): splitting a long prefill "
              "into budget-sized chunks batched with decodes bounds the stall a long prompt causes to running "
              "streams, at some cost to that prompt's TTFT.", "",
              f"**Setup**: {r['num_streams']} requests streaming {r['stream_output_len']} tokens each; once each has "
              f"streamed a few tokens a {r['long_len']}-token prompt arrives. Token budget per step "
              f"{', '.join(str(x['budget']) for x in r['rows'][:-1])}, and unchunked (the whole prompt in one step). ITL = gap between consecutive tokens of a stream.", ""
              ] + fig("fig6") + [
              "| budget | ITL median (ms) | ITL P99 (ms) | worst ITL (ms) | long prompt TTFT (s) |", "|---|---|---|---|---|"]
        for x in r["rows"]:
            L.append(f"| {x['budget']} | {1e3 * x['itl_median_s']:.0f} | {1e3 * x['itl_p99_s']:.0f} | "
                     f"{1e3 * x['itl_max_s']:.0f} | {x['long_ttft_s']:.2f} |")
        a, b = r["rows"][0], r["rows"][-1]
        L += ["", f"**Meaning**: unchunked, the streams stall for {1e3 * b['itl_max_s']:.0f} ms while the long prompt "
              f"prefills; with a {a['budget']}-token budget the worst gap is {1e3 * a['itl_max_s']:.0f} ms, and the long "
              f"prompt's TTFT goes from {b['long_ttft_s']:.2f} s to {a['long_ttft_s']:.2f} s. The budget trades stream "
              "smoothness against the newcomer's TTFT.", "", f"Reproduce: `{cmd(6)}`", ""]
    if "7" in S:
        r = S["7"]
        L += ["## 7. KV sizing", "",
              "**Claim**: KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per value; "
              "grouped-query attention (8 KV heads) keeps Llama 3.1 8B at 128 KiB per token in bf16.", "",
              f"**Setup**: computed from the models' configs (the Llama 3.1 config.json values written in "
              f"perf/bench/sections.py, the default model's imported config.json) with folio's "
              f"`ModelConfig.kv_bytes_per_token`; weights = 2 bytes x parameters counted from the config; tokens "
              f"that fit = (80 GiB - weights) / KV bytes per token (activations and the runtime's own memory "
              "ignored).", ""] + fig("fig7") + [
              "| model | layers | KV heads | head_dim | KV bytes/token (bf16) | parameters | weights (GiB) | "
              "tokens in 80 GiB beside the weights |", "|---|---|---|---|---|---|---|---|"]
        for x in r["rows"]:
            toks = f"{x['tokens_in_80gb']:,}" if x["fits"] else "0 (weights alone exceed 80 GiB)"
            L.append(f"| {x['model']} | {x['layers']} | {x['kv_heads']} | {x['head_dim']} | "
                     f"{x['kv_bytes_per_token_bf16']:,} ({x['kv_bytes_per_token_bf16'] / 1024:.1f} KiB) | "
                     f"{x['params'] / 1e9:.2f} B | {x['weights_bytes_bf16'] / 2**30:.1f} | {toks} |")
        mean = []
        for x in r["rows"]:
            if x["fits"]:
                mean.append(f"{x['model']} holds {x['tokens_in_80gb']:,} tokens of KV beside its weights "
                            f"({x['tokens_in_80gb'] // 8192:,} sequences of 8k tokens)")
            else:
                mean.append(f"{x['model']}'s bf16 weights alone exceed 80 GiB (it needs tensor parallelism or "
                            "quantisation)")
        L += ["", "**Meaning**: on one 80 GiB GPU, " + "; ".join(mean) + ".", "", f"Reproduce: `{cmd(7)}`", ""]
    L += ["## Timings", "", "| section | seconds |", "|---|---|"]
    L += [f"| {k} | {v:.0f} |" for k, v in data["timings_s"].items()]
    L += [f"| model load | {data.get('model_load_s', 0):.0f} |"]
    if data.get("warm_up_s") is not None:
        L += [f"| warm-up (kernels compiled before any section is timed) | {data['warm_up_s']:.0f} |"]
    L += [f"| total | {data['total_s']:.0f} |", ""]
    return "\n".join(L)
