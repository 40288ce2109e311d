"""perf/gpu_check.sh's dry run: every step of the GPU check runs here, with the CUDA kernel table
under the SIMT emulator instead of a GPU (FOLIO_GPU_CHECK_DRY=1), so that the first real run on a
lent GPU fails only on what truly needs one (a kernel the hardware runs differently from the
emulator, CUDA or cuBLAS refusing something, speed)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from simt.runner import require_compiler

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run(tmp_path):
    require_compiler()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOLIO_TEST_CUDA")}
    scratch = tmp_path / "tmp"      # the check's own temporary folders (dummy model configs) go here
    scratch.mkdir()
    env.update(FOLIO_GPU_CHECK_DRY="1", OUT=str(tmp_path / "out"), PYTHON=sys.executable, TMPDIR=str(scratch))
    tmp_path = tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "perf" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=1200)
    log = (tmp_path / "gpu_check.log").read_text() if (tmp_path / "gpu_check.log").exists() else ""
    assert r.returncode == 0, r.stderr[-3000:] + log[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["env"]["dry_run"] is True
    steps = res["steps"]
    assert {"install", "kernels", "golden", "bench_folio_small"} <= set(steps), steps.keys()
    for name, s in steps.items():
        assert s["rc"] == 0 and not s["timed_out"], (name, s, log[-4000:])
    k = steps["kernels"]["result"]
    assert k["tests"] > 50 and k["failures"] == 0 and k["errors"] == 0, k
    g = steps["golden"]["result"]
    assert g["forward"]["ok"] and g["forward"]["weights_identical"], g["forward"]
    assert g["graphs"]["ok"] and g["graphs"]["token_agreement"] == 1.0, g["graphs"]
    assert g["golden"].get("ok", True), g["golden"]
    b = steps["bench_folio_small"]["result"]
    assert b["ok"] and b["output_tokens"] == b["expected_output_tokens"], b
    left = sorted(p.name for p in scratch.glob("folio-*"))   # (pytest's own folders may stay)
    assert not left, f"the check left temporary folders behind: {left}"
