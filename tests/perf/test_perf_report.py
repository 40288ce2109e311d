"""The perf report (perf/bench/) at tiny sizes, so its code cannot rot.

One tiny report (all seven sections) is run once per module on the real default model; the tests
check its figures against expectations computed independently (block arithmetic, config
arithmetic, the contiguous allocator worked by hand) and that the two ways of measuring KV waste
agree. Peers (transformers, llama-cpp-python) run only where installed (the ``perf`` extra).
"""

import json
import os
import subprocess
import sys

import pytest

from perf.bench import llama_server
from perf.bench import peers
from perf.bench.common import BenchRequest, all_cores, random_requests
from perf.bench.kv_replay import simulate_contiguous
from perf.bench.report import ReportSize
from folio.runtime.common.config import cdiv

TINY = ReportSize.tiny()


@pytest.fixture(scope="module")
def report(tmp_path_factory, default_model_dir):
    """The tiny report through the CLI (every core, the default; section 3 also at 1 thread)."""
    out = tmp_path_factory.mktemp("perf")
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "report", "--tiny", "--out", str(out),
                        "--no-progress"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, json.loads((out / "report.json").read_text())


def test_workload_is_reproducible_and_in_range():
    a = random_requests(20, (32, 512), (16, 256), seed=3)
    b = random_requests(20, (32, 512), (16, 256), seed=3)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert all(32 <= len(r.prompt_token_ids) <= 512 and 16 <= r.output_len <= 256 for r in a)
    assert all(100 <= t < 49152 - 100 for r in a for t in r.prompt_token_ids)
    with pytest.raises(ValueError):
        random_requests(2, (5, 4), (1, 2), seed=0)


def test_contiguous_allocator_by_hand():
    # capacity 100 slots, reservation 50 each: two of three requests fit; the third waits.
    reqs = [BenchRequest([1] * 10, 3), BenchRequest([1] * 20, 2), BenchRequest([1] * 5, 1)]
    r = simulate_contiguous(reqs, 100, lambda q: 50, max_num_seqs=8, max_num_batched_tokens=100)
    # step 1: both prefill (10 + 20 held), request 1 (2 tokens) still needs one more
    # step 2: 11 + 21 held, request 1 done; step 3: request 0 at 12 done and request 2 prefilled (5)
    assert r["held"] == [30, 32, 17]
    assert r["reserved"] == [100, 100, 100]
    assert r["running"] == [2, 2, 2]
    assert r["num_steps"] == 3


def test_report_has_every_section_and_plots(report):
    out, data = report
    md = (out / "REPORT.md").read_text()
    for n, title in enumerate(["KV memory waste", "Continuous versus static", "Throughput against peers",
                               "Parallel sampling", "Prefix caching", "Chunked prefill", "KV sizing"], 1):
        assert f"## {n}. {title}" in md
        assert f"folio bench report --sections {n} --tiny" in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) >= 5
    for p in pngs:
        assert f"({p})" in md
    assert json.loads((out / "report.json").read_text())["sections"].keys() == {str(i) for i in range(1, 8)}


def test_section1_paged_beats_max_len_reservation_and_matches_section3(report):
    _, data = report
    s = data["sections"]["1"]["poisson"]["summary"]
    paged, maxlen = s["paged (folio block pool)"], s["contiguous, max_model_len"]
    assert paged["waste"] < maxlen["waste"]
    assert paged["batch_size_max"] > maxlen["batch_size_max"]
    # reserving max_model_len in capacity C allows exactly C // max_model_len requests at once
    assert maxlen["batch_size_max"] <= TINY.s1_num_blocks * 16 // TINY.s1_max_model_len
    # the model-free replay and the real run's block-pool counters agree exactly (ignore_eos)
    c = data["consistency"]
    assert c["match"], c


def test_section3_counts_every_token(report):
    _, data = report
    r = data["sections"]["3"]
    want = sum(q.output_len for q in random_requests(TINY.s3_num_prompts, TINY.s3_input_len, TINY.s3_output_len,
                                                     seed=0))
    assert r["folio"]["output_tokens"] == want
    assert r["folio"]["output_tokens_per_s"] > 0


def _runs(report):
    s3 = report[1]["sections"]["3"]
    return [s3] + s3["other_threads"]


def test_section3_runs_at_every_thread_count_and_kernel_rates(report):
    # the tiny report runs with --threads = every core; section 3 adds a 1-thread run
    runs = _runs(report)
    assert sorted(r["engine"]["threads"] for r in runs) == sorted({1, all_cores()})
    for r in runs:
        assert r["folio"]["output_tokens"] == report[1]["sections"]["3"]["folio"]["output_tokens"]
    k = report[1]["sections"]["3"]["kernel_rates"]
    assert [r["threads"] for r in k["runs"]] == sorted({1, all_cores()})
    for r in k["runs"]:
        assert r["copy_gbs"] > 0 and r["read_gbs"] > 0 and all(d["gflops"] > 0 for d in r["batched_products"] + r["attention"])
        assert all(d["gather_gbs"] > 0 if d["kind"] == "decode" else d["sgemm_tile_gflops"] > 0 for d in r["attention"])
        assert all(d["plan_us"] > 0 and len(d["tile_shape"]) == 2 for d in r["attention"] if d["kind"] == "prefill")
        # with 2+ threads also as phases of one region (the forward's way); with 1 there is no region
        region = [d.get("gbs_region") or d.get("gflops_region") for d in
                  r["decode_products"] + r["batched_products"] + r["attention"]]
        assert all(x is not None and x > 0 for x in region) if r["threads"] > 1 else not any(region)
    md = (report[0] / "REPORT.md").read_text()
    assert "CPU kernel rates against this machine's limits" in md
    assert ("the same work as phases of one parallel region" in md) == (all_cores() > 1)


@pytest.mark.parametrize("peer", peers.PEERS)
def test_section3_peer(report, peer):
    ok, why = peers.available(peer)
    if not ok:
        pytest.skip(f"{peer} peer: {why}")
    if peer == "llama-cpp-server" and not llama_server.built():
        pytest.skip("llama-server not built (make -C perf/llama.cpp); the tiny report does not build it")
    for i, run in enumerate(_runs(report)):
        if i > 0 and peer not in TINY.s3_peers_one_thread:
            continue
        keys = [k for k in run["peers"] if k.startswith(peer + "-")] if peer == "llama-cpp-server" else [peer]
        assert keys, run["peers"].keys()
        for key in keys:  # llama-cpp-server: F32 and the GGUF as shipped
            p = run["peers"][key]
            assert "skipped" not in p, p
            assert p["output_tokens"] == run["folio"]["output_tokens"]
            assert p["output_tokens_per_s"] > 0 and p["threads"] == run["engine"]["threads"]


ZEN3_FLAGS = "fpu sse2 avx fma f16c bmi2 avx2 sha_ni"  # AVX2, no AVX-512
ZEN4_FLAGS = ZEN3_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx512_vnni avx512_bf16"  # no AVX-VNNI
ZEN5_FLAGS = ZEN4_FLAGS + " avx_vnni"
ICELAKE_FLAGS = ZEN4_FLAGS.replace(" avx512_bf16", "")  # no BF16
QEMU64_FLAGS = "fpu sse2 sse4_2 popcnt"  # no AVX2: no build runs


@pytest.mark.parametrize("flags, level", [(ZEN3_FLAGS, "avx2"), (ZEN4_FLAGS, "avx512"), (ZEN5_FLAGS, "avx512"),
                                          (ICELAKE_FLAGS, "avx2"), (QEMU64_FLAGS, None), ("", None)])
def test_llama_server_build_level_is_the_makefiles(flags, level):
    """folio looks for llama-server in the folder of the level perf/llama.cpp/Makefile builds on the same
    CPU: a binary with instructions the CPU lacks is never started (it trapped with SIGILL once)."""
    assert llama_server.host_isa(f"processor : 0\nflags\t\t: {flags}\n") == level
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ISA")}
    r = subprocess.run(["make", "-s", "--no-print-directory", "-C", str(llama_server.BENCHMARK_DIR), "isa",
                        f"CPU_FLAGS={flags}"], capture_output=True, text=True, timeout=60, env={**env, "ISA": "avx2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (level or "avx2")   # an ISA in the environment is ignored


@pytest.mark.parametrize("host, override, want", [
    (ZEN5_FLAGS, None, "avx512"), (ZEN5_FLAGS, "avx2", "avx2"), (ZEN3_FLAGS, None, "avx2"),
    (ZEN3_FLAGS, "avx512", "lacks avx512"), (ZEN5_FLAGS, "AVX512", "one of avx2, avx512"),
    (ZEN5_FLAGS, "sse4", "one of avx2, avx512"), (QEMU64_FLAGS, None, "lacks avx2")])
def test_llama_server_level_override_and_refusals(monkeypatch, host, override, want):
    # FOLIO_LLAMA_CPP_ISA may take a lower level, never one this CPU lacks; the peer is then
    # skipped with the reason (available() answers, it does not raise)
    cpuinfo = f"flags\t\t: {host}\n"
    monkeypatch.setattr(llama_server, "cpu_flags", lambda c=None, _f=llama_server.cpu_flags: _f(c or cpuinfo))
    monkeypatch.delenv("FOLIO_LLAMA_CPP_BIN", raising=False)
    if override is None:
        monkeypatch.delenv("FOLIO_LLAMA_CPP_ISA", raising=False)
    else:
        monkeypatch.setenv("FOLIO_LLAMA_CPP_ISA", override)
    if want in ("avx2", "avx512"):
        assert llama_server.isa() == want
        assert llama_server.tools_dir().parent.name == f"llama.cpp-{want}"
        return
    with pytest.raises(ValueError, match=want):
        llama_server.isa()
    ok, why = llama_server.available()
    assert not ok and want in why
    assert peers.available("llama-cpp-server") == (False, why)


def test_section4_block_counts(report):
    _, data = report
    P, O = TINY.s4_prompt_len, TINY.s4_output_len
    shared_full = (P - 1) // 16  # blocks never written after the fork
    per_seq = cdiv(P + O - 1, 16)  # the last sampled token is never computed
    for row in data["sections"]["4"]["rows"]:
        n = row["n"]
        assert row["separate"]["peak_blocks"] == n * per_seq * TINY.s4_num_prompts
        assert row["shared"]["peak_blocks"] == (shared_full + n * (per_seq - shared_full)) * TINY.s4_num_prompts
        assert row["shared"]["output_tokens"] == row["separate"]["output_tokens"] == n * O * TINY.s4_num_prompts


def test_section4_beam_search_block_counts(report):
    _, data = report
    P, O = TINY.s4_prompt_len, TINY.s4_output_len
    per_beam = cdiv(P + O - 1, 16)   # the last token chosen is never computed
    shared_full = P // 16            # the first beam computes the whole prompt; full blocks stay shared
    rows = data["sections"]["4"]["beam_rows"]
    assert [r["beam_width"] for r in rows] == list(TINY.s4_beam_widths)
    for r in rows:
        w = r["beam_width"]
        assert r["separate"]["peak_blocks"] == w * per_beam * TINY.s4_num_prompts
        assert r["shared"]["peak_blocks"] == (shared_full + w * (per_beam - shared_full)) * TINY.s4_num_prompts
        assert r["same_results"]
        assert r["shared"]["output_tokens"] == r["separate"]["output_tokens"] == w * O * TINY.s4_num_prompts


def test_update_reruns_one_section_and_keeps_the_others(report, tmp_path):
    import shutil
    out, before = report
    shutil.copytree(out, tmp_path / "perf")
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "report", "--tiny", "--sections", "7",
                        "--update", "--out", str(tmp_path / "perf"), "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    after = json.loads((tmp_path / "perf" / "report.json").read_text())
    assert {k: v for k, v in after["sections"].items() if k != "7"} == \
        {k: v for k, v in before["sections"].items() if k != "7"}
    assert after["sections"]["7"] == before["sections"]["7"]   # computed, not measured: the same again
    assert [u["sections"] for u in after["reruns"]] == [["7"]]
    md = (tmp_path / "perf" / "REPORT.md").read_text()
    assert "Section(s) 7 rerun" in md and "## 1. KV memory waste" in md


def test_section5_hits_and_changed_token(report):
    _, data = report
    r = data["sections"]["5"]
    assert r["off"]["hit_rate"] == 0 and r["off"]["cached_tokens"] == 0
    assert r["on"]["hit_rate"] > 0
    # all but the first question reuse the system prompt's full blocks
    assert r["on"]["cached_tokens"] >= (TINY.s5_num_questions - 1) * (TINY.s5_system_len // 16) * 16
    for c in r["changed_token"]:
        assert c["cached_tokens"] == (c["position"] // 16) * 16
    assert r["unchanged"]["cached_tokens"] == (TINY.s5_system_len // 16) * 16


def test_section6_streams_complete(report):
    _, data = report
    r = data["sections"]["6"]
    assert [x["budget"] for x in r["rows"]] == list(TINY.s6_budgets) + ["unchunked"]
    for x in r["rows"]:
        assert len(x["itls"]) == TINY.s6_num_streams * (TINY.s6_stream_output_len - 1)
        assert x["long_ttft_s"] > 0 and x["itl_p99_s"] >= x["itl_median_s"] > 0


def test_section7_sizes(report):
    rows = {x["model"]: x for x in report[1]["sections"]["7"]["rows"]}
    assert rows["Llama 3.1 8B"]["kv_bytes_per_token_bf16"] == 128 * 1024
    assert rows["Llama 3.1 70B"]["kv_bytes_per_token_bf16"] == 2 * 80 * 8 * 128 * 2
    assert rows["SmolLM2-135M (default)"]["kv_bytes_per_token_bf16"] == 2 * 30 * 3 * 64 * 2
    assert abs(rows["Llama 3.1 8B"]["params"] - 8.03e9) < 0.01e9  # published 8.03B
    assert abs(rows["Llama 3.1 70B"]["params"] - 70.55e9) < 0.05e9  # published 70.6B
    assert not rows["Llama 3.1 70B"]["fits"]
    x = rows["Llama 3.1 8B"]
    assert x["tokens_in_80gb"] == (80 * 2**30 - x["weights_bytes_bf16"]) // x["kv_bytes_per_token_bf16"]


def test_cli_throughput_prints_figures(default_model_dir):
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "throughput", "--num-prompts", "3",
                        "--input-len", "8", "16", "--output-len", "2", "4", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "command: folio bench throughput --num-prompts 3" in out
    assert "folio (continuous batching)" in out and "mean waste" in out
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "throughput", "--input-len", "9", "3"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "MIN <= MAX" in r.stderr


def test_rerender_from_json_gives_the_same_report(report):
    from perf.bench.report import rerender
    out, _ = report
    before = (out / "REPORT.md").read_text()
    (out / "REPORT.md").unlink()
    rerender(out)
    assert (out / "REPORT.md").read_text() == before


def test_gather_read_sums_exactly_the_blocks_of_the_tables():
    # the decode-attention limit of `folio bench kernels` must read every block of every
    # sequence's table once (and no other): its sum equals NumPy's over those blocks (integers
    # small enough that float32 sums are exact in any order)
    import numpy as np

    from perf.bench.kernel_rates import _gather_read
    rng = np.random.default_rng(0)
    kc = rng.integers(-3, 4, (20, 4, 2, 8)).astype(np.float32)
    vc = rng.integers(-3, 4, (20, 4, 2, 8)).astype(np.float32)
    tables = np.array([[5, 2, 17, 0], [9, 11, 0, 0], [3, 0, 0, 0]], np.int64)
    seq_lens = np.array([13, 5, 4], np.int64)
    blocks = [5, 2, 17, 0, 9, 11, 3]
    want = kc[blocks].sum() + vc[blocks].sum()
    for tasks in (1, 2, 3):
        assert _gather_read(kc, vc, tables, seq_lens, tasks) == want


@pytest.mark.parametrize("T", [1, 3, 64])
def test_products_in_one_region_compute_the_forwards_products(T):
    # the "in one region" product figures of `folio bench kernels` must run the work items of the
    # per-call kernel: same items, same dot / sgemm code, so the same bits as `linear`
    import numba
    import numpy as np

    from perf.bench.kernel_rates import _model_weights, products_region_call
    from folio.kernels.cpu.table import linear
    from folio.kernels.cpu.threads import numba_threads
    stacks = _model_weights(np.random.default_rng(0), 3)
    assert all(st.shape[0] == 3 for st in stacks)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((T, st.shape[2]), dtype=np.float32) for st in stacks]
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    with numba_threads(threads):
        run, ys = products_region_call(xs, stacks, threads)
        run()
        want = [linear(x, st[2]) for x, st in zip(xs, stacks)]   # the last layer's products stay
        run1, ys1 = products_region_call(xs[2:3], [stacks[2][1:2]], threads, reps=3)   # one kind, repeated
        run1()
        want1 = linear(xs[2], stacks[2][1])
    for g, w in zip(ys, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(ys1[0], want1)


@pytest.mark.parametrize("seqs", [[(40, 1), (100, 1), (7, 1)], [(60, 60)], [(33, 9), (80, 1)]])
def test_attention_in_one_region_computes_paged_attention(seqs):
    # the "in one region" attention figures run the items of the per-call kernel, layer by layer,
    # with the merge of split decodes after each: the same bits as paged_attention per layer
    import numba
    import numpy as np

    from perf.bench.kernel_rates import attention_case, attention_region_call
    from folio.kernels.cpu.attention import paged_attention
    from folio.kernels.cpu.threads import numba_threads
    q, caches, bt, sl, qsl = attention_case(np.random.default_rng(2), seqs, layers=2, dtype=np.int64)
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    with numba_threads(threads):
        run, out = attention_region_call(q, caches, bt, sl, qsl, threads)
        run()
        want = paged_attention(q, *caches[1], bt, sl, qsl, q.shape[2] ** -0.5)
    np.testing.assert_array_equal(out, want)


def test_peak_rss_counts_pages_a_process_touched():
    # VmHWM is the high-water mark of resident pages: touching 256 MiB more than ever before must
    # raise it by at least that much (the pages are written, so they are resident at once).
    before = llama_server.peak_rss_bytes()
    import numpy as np
    a = np.ones(256 * 2**20 + before, dtype=np.uint8)  # more than the peak so far, so it is a new peak
    after = llama_server.peak_rss_bytes()
    assert after >= a.nbytes
    assert llama_server.peak_rss_bytes(2**31) is None  # no such process


def test_peer_runs_a_gguf_file_as_is(tmp_path):
    f = tmp_path / "model-shape.Q4_K_M.gguf"
    f.write_bytes(b"GGUF")
    assert llama_server.peer_files(str(f)) == [("Q4_K_M", f)]
    assert llama_server.gguf_file(str(tmp_path / "missing.gguf")) is None
    assert llama_server.gguf_file("smollm2-135m-instruct") is None


def test_latency_figures_are_the_step_times(default_model_dir, tmp_path):
    out = tmp_path / "lat.json"
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "latency", "--input-len", "16", "--output-len",
                        "4", "--num-iters", "2", "--threads", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "command: folio bench latency --input-len 16" in r.stdout and "prefill tok/s" in r.stdout
    f = json.loads(out.read_text())["folio"]
    assert len(f["iters"]) == 2 and len(f["token_ids"]) == 4
    for it in f["iters"]:
        assert it["output_tokens"] == 4
        assert it["prefill_tok_s"] == pytest.approx(16 / it["ttft_s"])
        assert it["decode_tok_s"] == pytest.approx(3 / it["decode_s"])
    cfg = json.loads((default_model_dir / "config.json").read_text())
    assert f["peak_rss_bytes"] > 4 * cfg["vocab_size"] * cfg["hidden_size"]  # the float32 embedding alone
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "latency", "--output-len", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "output-len must be >= 2" in r.stderr


def _needs_llama_server():
    ok, why = llama_server.available()
    if not ok or not llama_server.built():
        pytest.skip(f"llama-server not built (make -C perf/llama.cpp, or FOLIO_LLAMA_CPP_BIN): {why}")


def test_throughput_on_a_gguf_file_runs_both_engines_on_that_file(default_model_dir, tmp_path):
    _needs_llama_server()
    from folio.model.registry import find_packaged_gguf
    gguf = find_packaged_gguf("smollm2-135m-instruct")
    out = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "throughput", "--model", str(gguf),
                        "--peer", "llama-cpp-server", "--num-prompts", "3", "--input-len", "8", "16",
                        "--output-len", "2", "4", "--threads", "1", "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert list(got["peers"]) == ["llama-cpp-server-q4_1"]  # the file as is: no F32 copy
    p = got["peers"]["llama-cpp-server-q4_1"]
    assert p["gguf"] == str(gguf) and f"-m {gguf}" in p["command"]
    assert p["output_tokens"] == got["workload"]["output_tokens"] == got["folio"]["output_tokens"]
    assert p["peak_rss_bytes"] > 0 and got["folio"]["peak_rss_bytes"] > 0
    r = subprocess.run([sys.executable, "-m", "folio.cli", "bench", "latency", "--model", str(gguf), "--peer",
                        "llama-cpp-server", "--no-folio", "--input-len", "16", "--output-len", "4", "--num-iters",
                        "1", "--threads", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["folio"] == {"skipped": "not run (--no-folio)"}
    p = got["peers"]["llama-cpp-server-q4_1"]
    assert p["prompt_tokens"] == 16 and len(p["token_ids"]) == 4 and "agreement" not in p
    assert p["iters"][0]["decode_tok_s"] == pytest.approx(3 / p["iters"][0]["decode_s"])
