"""The llama.cpp server peer: ``llama-server`` with parallel slots and continuous batching.

A user serving a model on CPUs today runs llama.cpp's own HTTP server, which batches every
running request into one forward pass per step (``--parallel`` slots, continuous batching), not
one request at a time. This peer runs the throughput workload through it:

* the binaries (``llama-server``, ``llama-quantize``) are built by ``perf/llama.cpp/Makefile`` from
  the llama.cpp source carried by the pinned llama-cpp-python source distribution (downloaded
  from PyPI at build time; nothing of llama.cpp is kept in the repository), or taken from
  ``$FOLIO_LLAMA_CPP_BIN``. The build is one of two explicit instruction-set levels (``isa()``:
  ``avx512`` where this host has every AVX-512 extension ggml uses, else ``avx2``; never
  ``-march=native``), each in its own folder, so the peer runs with the vector width this CPU
  has and folio does not start a build whose level the CPU lacks (``FOLIO_LLAMA_CPP_ISA=avx2``
  takes the AVX2 build on an AVX-512 CPU; a higher level than the CPU's is refused);
* the model is the same GGUF file folio imports, once as shipped (Q4_1) and once converted to
  F32 with ``llama-quantize --allow-requantize ... F32`` (folio's own precision; the file is
  cached in ``$FOLIO_HOME/llama-cpp/``);
* the server gets as many slots as requests run at once in folio (all of them here), a KV
  stream per slot (llama.cpp's default) holding the longest request's prompt plus output, the
  same thread count for generation and prompt processing, and llama.cpp's default
  batch sizes (``-b 2048`` like folio's token budget, ``-ub 512``);
* every request is sent at once over HTTP (``POST /completion`` with the prompt's token ids,
  ``n_predict`` = the output length, ``ignore_eos``, greedy), and the wall time runs from the
  first send to the last answer.

Source: llama.cpp ``tools/server/README.md`` (the ``/completion`` and ``/health`` endpoints).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import BenchRequest, cpu_flags, peer_env

BENCHMARK_DIR = Path(__file__).resolve().parents[1] / "llama.cpp"
BUILD_MINUTES = 15  # perf/llama.cpp/Makefile on 2 cores


# The CPU flags (as /proc/cpuinfo names them) of perf/llama.cpp/Makefile's two levels: ``avx2``
# (GGML_AVX2, FMA, F16C, BMI2) and ``avx512`` (that plus GGML_AVX512: F, CD, VL, DQ, BW; and
# GGML_AVX512_VBMI / _VNNI / _BF16).
AVX2_FLAGS = ("avx2", "fma", "f16c", "bmi2")
AVX512_FLAGS = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni",
                "avx512_bf16")
ISA_NAMES = {"avx2": "AVX2", "avx512": "AVX-512"}


def host_isa(cpuinfo: str | None = None) -> str | None:
    """The highest level this CPU runs: ``"avx512"`` (every flag of ``AVX512_FLAGS``), ``"avx2"``
    (every flag of ``AVX2_FLAGS``), else None (no build of perf/llama.cpp/Makefile runs here). The
    Makefile chooses the same level where there is one (and ``avx2`` where there is none)."""
    flags = cpu_flags(cpuinfo)
    if set(AVX512_FLAGS) <= flags:
        return "avx512"
    return "avx2" if set(AVX2_FLAGS) <= flags else None


def custom_bin() -> str | None:
    """``$FOLIO_LLAMA_CPP_BIN`` (a folder with the user's own llama-server and llama-quantize), or None."""
    return os.environ.get("FOLIO_LLAMA_CPP_BIN") or None


def isa() -> str:
    """The build level the peer uses: ``$FOLIO_LLAMA_CPP_ISA`` (``avx2`` or ``avx512``), else
    ``host_isa()``.

    Raises:
        ValueError: ``$FOLIO_LLAMA_CPP_ISA`` names another level, or one this CPU lacks the
            instructions of; or this CPU runs neither level.
    """
    level, host = os.environ.get("FOLIO_LLAMA_CPP_ISA"), host_isa()
    if level is not None and level not in ISA_NAMES:
        raise ValueError(f"FOLIO_LLAMA_CPP_ISA={level!r}: one of avx2, avx512")
    if host is None or (level == "avx512" and host != "avx512"):
        need = AVX2_FLAGS if host is None else AVX512_FLAGS
        lacks = sorted(set(need) - cpu_flags())
        raise ValueError(f"this CPU lacks {', '.join(lacks)}: no {ISA_NAMES[level or 'avx2']} build of "
                         "llama-server runs here (FOLIO_LLAMA_CPP_BIN names a build of your own)")
    return level or host


def tools_dir() -> Path:
    """Where ``llama-server`` and ``llama-quantize`` are (or will be built):
    ``$FOLIO_LLAMA_CPP_BIN``, else ``perf/llama.cpp/build/llama.cpp-<isa()>/bin``.

    Raises:
        ValueError: from ``isa()``.
    """
    own = custom_bin()
    return Path(own) if own else BENCHMARK_DIR / "build" / f"llama.cpp-{isa()}" / "bin"


def built() -> bool:
    """Whether both tools are there (``tools_dir()``; raises its ValueError)."""
    d = tools_dir()
    return all(os.access(d / n, os.X_OK) for n in ("llama-server", "llama-quantize"))


def available() -> tuple[bool, str]:
    """(whether the peer can run here, possibly after building it; the reason when not)."""
    try:
        if built():
            return True, ""
    except ValueError as e:     # no build level for this CPU, or a bad $FOLIO_LLAMA_CPP_ISA
        return False, str(e)
    if custom_bin():
        return False, f"no llama-server / llama-quantize in $FOLIO_LLAMA_CPP_BIN={tools_dir()}"
    if not (BENCHMARK_DIR / "Makefile").exists():
        return False, "needs a folio source checkout (perf/llama.cpp/Makefile builds llama-server)"
    missing = [t for t in ("make", "cmake", "c++") if shutil.which(t) is None]
    if missing:
        return False, f"cannot build llama-server: {', '.join(missing)} not found"
    return True, ""


def ensure_built(log=print) -> Path:
    """Build the tools with ``make -C perf/llama.cpp`` when they are missing; returns ``tools_dir()``.

    Raises:
        RuntimeError: the build failed (the message ends with its last lines).
    """
    if not built():
        log(f"building llama-server from the pinned llama-cpp-python sdist (make -C {BENCHMARK_DIR} "
            f"ISA={isa()}, about {BUILD_MINUTES} min on 2 cores) ...")
        p = subprocess.run(["make", "-C", str(BENCHMARK_DIR), f"ISA={isa()}"], capture_output=True, text=True)
        if p.returncode != 0 or not built():
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-5:])
            raise RuntimeError(f"make -C {BENCHMARK_DIR} ISA={isa()} failed:\n{tail}")
    return tools_dir()


def f32_gguf(src: Path) -> Path:
    """``src`` converted to F32 with ``llama-quantize`` (cached next to folio's models)."""
    from folio.model.registry import folio_home
    out = folio_home() / "llama-cpp" / (Path(src).stem + ".F32.gguf")
    if out.exists() and out.stat().st_mtime >= Path(src).stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    p = subprocess.run([str(tools_dir() / "llama-quantize"), "--allow-requantize", str(src), str(tmp), "F32"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"llama-quantize failed: {(p.stdout + p.stderr).strip()[-300:]}")
    tmp.replace(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """The peak resident set size of process ``pid`` so far (``VmHWM`` of ``/proc/<pid>/status``:
    every page it has had resident at once, file-backed pages of a memory-mapped model included),
    in bytes; None where ``/proc`` cannot tell (not Linux, the process gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class LlamaServer:
    """A ``llama-server`` on ``gguf`` for the life of a ``with`` block, on a free loopback port.

    Args:
        threads: generation and prompt-processing threads (``-t``, ``-tb``).
        parallel: slots (``-np``). n_ctx: the context of all slots together (``-c``; each slot
            gets ``n_ctx / parallel``).
    Attributes (after entering): base (the URL), load_s (start to healthy), command (the command
    line, with ``llama-server`` for the binary's path).
    Raises (on entering):
        RuntimeError: the server exited or did not become healthy within 300 s (its log's last lines).
    """

    def __init__(self, gguf, threads: int, parallel: int, n_ctx: int):
        port = _free_port()
        self.cmd = [str(tools_dir() / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                    "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(n_ctx), "-b", "2048",
                    "-ub", "512", "--no-webui"]
        self.threads, self.base = threads, f"http://127.0.0.1:{port}"
        self.command = shlex.join(["llama-server", *self.cmd[1:]])
        self.proc = None
        self.log = None
        self.load_s = None

    def fail(self, why: str) -> RuntimeError:
        self.log.flush()
        self.log.seek(0)
        tail = " ".join(self.log.read().strip().splitlines()[-3:])[-400:]
        return RuntimeError(f"llama-server {why}: {tail}")

    def __enter__(self):
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="llama-server-")
        t0 = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                         env=peer_env(self.threads))
            deadline = time.monotonic() + 300
            while True:  # /health answers 503 while the model loads
                if self.proc.poll() is not None:
                    raise self.fail(f"exited with {self.proc.returncode}")
                try:
                    with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise self.fail("did not become healthy within 300 s")
                time.sleep(0.2)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.load_s = time.perf_counter() - t0
        return self

    def completion(self, body: dict, timeout: float) -> dict:
        """``POST /completion`` with ``body``; the answer (its ``timings`` hold the server's own
        prompt and generation times)."""
        return _post(self.base + "/completion", body, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def peak_rss_bytes(self) -> int | None:
        """The server's peak RSS so far (``peak_rss_bytes``)."""
        return peak_rss_bytes(self.proc.pid) if self.alive() else None

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log is not None:
            self.log.close()


def greedy_body(prompt_token_ids: list[int], n_predict: int, return_tokens: bool = False) -> dict:
    """A ``/completion`` request for exactly ``n_predict`` greedy tokens after ``prompt_token_ids``
    (no prompt cache, so every request computes its whole prompt; ``return_tokens``: the answer
    carries the generated token ids in ``tokens``)."""
    return {"prompt": prompt_token_ids, "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
            "top_k": 1, "cache_prompt": False, "return_tokens": return_tokens}


def run_llama_server(gguf, requests: list[BenchRequest], threads: int, parallel: int | None = None,
                     progress=None, timeout: float = 3600.0) -> dict:
    """Serve ``requests`` (all sent at once) with ``llama-server`` on ``gguf``.

    Args:
        parallel: server slots (default: one per request, as folio runs them all at once).
    Returns:
        dict: wall_s, requests, output_tokens, prompt_tokens, load_s, threads, parallel, n_ctx,
        peak_rss_bytes (the server's, at the end of the run), gguf, isa (the build level, or
        ``"$FOLIO_LLAMA_CPP_BIN"``), command (the server's command line).
    Raises:
        RuntimeError: the server exited or did not become healthy (its log's last lines).
    """
    parallel = parallel or len(requests)
    # One KV stream per slot (llama.cpp's default): each sequence's attention reads only its own
    # cache. ``--kv-unified`` (one buffer shared by every slot) made every decode attend over the
    # whole shared buffer under a mask: 1.6x slower on this workload (perf/RESULTS.md, issue 9).
    n_ctx_slot = max(len(r.prompt_token_ids) + r.output_len for r in requests) + 16
    n_ctx = n_ctx_slot * parallel
    with LlamaServer(gguf, threads, parallel, n_ctx) as server:

        def one(r: BenchRequest) -> int:
            out = server.completion(greedy_body(r.prompt_token_ids, r.output_len), timeout)
            if progress is not None:
                progress.update(1)
            return int(out.get("tokens_predicted", 0))

        start = time.perf_counter()
        with ThreadPoolExecutor(len(requests)) as pool:
            produced = list(pool.map(one, requests))
        wall = time.perf_counter() - start
        if not server.alive():
            raise server.fail(f"exited with {server.proc.returncode} during the run")
        rss = server.peak_rss_bytes()
    return {"wall_s": wall, "requests": len(requests), "output_tokens": sum(produced),
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests), "load_s": server.load_s,
            "threads": threads, "parallel": parallel, "n_ctx": n_ctx, "peak_rss_bytes": rss, "gguf": str(gguf),
            "isa": "$FOLIO_LLAMA_CPP_BIN" if custom_bin() else isa(), "command": server.command}


def run_llama_server_latency(gguf, prompt_token_ids: list[int], output_len: int, threads: int, num_iters: int = 3,
                             num_iters_warmup: int = 1, timeout: float = 3600.0) -> dict:
    """One request at a time on a one-slot ``llama-server``: prefill and decode rates.

    Each iteration sends the same prompt (no prompt cache) for exactly ``output_len`` greedy
    tokens and reads the server's own ``timings``: ``prompt_ms`` runs from the request's start to
    its first sampled token (the whole prompt's forward pass), ``predicted_ms`` from there to the
    last token (``output_len - 1`` forward passes of one token; llama.cpp
    ``tools/server/server-common.h``, ``server_slot_stats``). ``num_iters_warmup`` untimed
    iterations come first (the first one faults the memory-mapped weights in).

    Returns:
        dict: prompt_tokens, output_tokens, iters (per iteration: ttft_s, decode_s, prefill_tok_s,
        decode_tok_s, output_tokens), token_ids (the last iteration's output), load_s, threads, peak_rss_bytes, gguf, isa, command.
    Raises:
        RuntimeError: the server failed, or produced other token counts than asked.
    """
    if output_len < 2:
        raise ValueError("output_len must be >= 2 (decode is timed from the first token to the last)")
    n_ctx = len(prompt_token_ids) + output_len + 16
    iters = []
    with LlamaServer(gguf, threads, 1, n_ctx) as server:
        for i in range(num_iters_warmup + num_iters):
            out = server.completion(greedy_body(prompt_token_ids, output_len, return_tokens=True), timeout)
            t = out.get("timings") or {}
            n_prompt, n_out = int(t.get("prompt_n", -1)), int(out.get("tokens_predicted", -1))
            if n_prompt != len(prompt_token_ids) or n_out != output_len:
                raise RuntimeError(f"llama-server computed {n_prompt} prompt tokens and {n_out} output tokens, "
                                   f"asked {len(prompt_token_ids)} and {output_len}")
            if i >= num_iters_warmup:
                ttft, dec = t["prompt_ms"] / 1e3, t["predicted_ms"] / 1e3
                iters.append({"ttft_s": ttft, "decode_s": dec, "output_tokens": n_out,
                              "prefill_tok_s": n_prompt / ttft, "decode_tok_s": (n_out - 1) / dec})
        rss = server.peak_rss_bytes()
    return {"prompt_tokens": len(prompt_token_ids), "output_tokens": output_len, "iters": iters,
            "token_ids": [int(x) for x in out.get("tokens") or []] or None, "load_s": server.load_s, "threads": threads, "peak_rss_bytes": rss, "gguf": str(gguf),
            "isa": "$FOLIO_LLAMA_CPP_BIN" if custom_bin() else isa(), "command": server.command}


def gguf_file(model) -> Path | None:
    """``model`` as a GGUF file path when it names one (``--model FILE.gguf``), else None."""
    path = Path(str(model)).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def quant_name(gguf) -> str:
    """The weight type a GGUF file name states (``...Q4_1.gguf`` -> ``Q4_1``), else ``as shipped``."""
    stem = Path(gguf).stem
    return stem.rsplit(".", 1)[1] if "." in stem else "as shipped"


def peer_files(model) -> list[tuple[str, Path]]:
    """The ``(weight type, GGUF file)`` runs of the peer for ``model``: a GGUF file as is (``--model
    FILE.gguf``: both engines on that one file); a known model name's packaged GGUF as F32
    (``f32_gguf``, folio's float32 precision) and as shipped.

    Raises:
        ValueError / FileNotFoundError: ``find_packaged_gguf``'s. RuntimeError: ``f32_gguf``'s.
    """
    own = gguf_file(model)
    if own is not None:
        return [(quant_name(own), own)]
    from folio.model.registry import find_packaged_gguf
    shipped = find_packaged_gguf(model)
    return [("F32", f32_gguf(shipped)), (quant_name(shipped), shipped)]


def peer_ready(build: bool = True) -> str | None:
    """None when the peer can run now (building it first when ``build``), else why not."""
    ok, why = available()
    if ok and not build and not built():
        ok, why = False, f"not built (make -C {BENCHMARK_DIR} ISA={isa()})"
    if not ok:
        return why
    try:
        ensure_built()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def run_peer(model: str, requests: list[BenchRequest], threads: int, parallel: int, progress: bool = True,
             build: bool = True) -> dict:
    """The peer's runs on ``model`` (``peer_files``): ``{key: figures or {"skipped": reason}}``,
    keys ``llama-cpp-server-<type>`` (``-f32`` and ``-q4_1`` for the default model; one key for a
    GGUF file), each with a ``label``."""
    from tqdm.auto import tqdm

    why = peer_ready(build)
    if why is not None:
        return {"llama-cpp-server": {"skipped": why}}
    try:
        runs = peer_files(model)
    except (RuntimeError, ValueError, OSError) as e:
        return {"llama-cpp-server": {"skipped": str(e)}}
    out = {}
    level = "" if custom_bin() else f", {ISA_NAMES[isa()]} build"
    for quant, path in runs:
        key, label = f"llama-cpp-server-{quant.lower()}", f"llama-server {quant} ({parallel} slots{level})"
        bar = tqdm(total=len(requests), desc=f"llama-server {quant}", disable=not progress, dynamic_ncols=True)
        try:
            out[key] = {"label": label, **run_llama_server(path, requests, threads, parallel, progress=bar)}
        except (RuntimeError, OSError) as e:
            out[key] = {"label": label, "skipped": str(e)}
        bar.close()
    return out
