#!/usr/bin/env bash
# perf/gpu_check.sh: everything folio checks on one NVIDIA GPU, in one run of under 9 minutes on an
# H200 with no network (the device tool's machine: python3 with CuPy 14 for CUDA 13, numba,
# tokenizers, torch, transformers; no pyzmq or gguf, which these checks do not need). Results:
# $OUT/gpu_check.json (one object: environment, each step's exit status and seconds, and its
# results) and $OUT/gpu_check.log (all output).
#
# Steps (each under its own time limit, so one slow step cannot sink the rest):
#   install         make `import folio` work offline (pip install --no-deps --no-index -e .; wheels of
#                   missing dependencies are taken from $FOLIO_WHEELS, default ./wheels, if present),
#                   then warm the caches the later steps would otherwise pay for inside their own
#                   limits: every CUDA kernel compiled by NVRTC into CuPy's disk cache, and Numba's
#                   CPU kernels (the forward check's CPU side) compiled for this Python, in parallel
#   kernels         every CUDA kernel test against kernels/reference.py on the GPU, the mma.sync
#                   fragment layout check, NVRTC compiles (FOLIO_TEST_CUDA=1 pytest ...)
#   golden          perf/gpu_check_golden.py: the GPU forward checked op by op against the spec with
#                   the same weights as a CPU forward; CUDA graphs against eager decode; the golden
#                   greedy cases of the default model (skipped, with the reason, when it is absent)
#   cli             `python -m folio.cli generate --device cuda ... --json` (only with the real model)
#   bench_*         throughput, nano-vllm's workload (256 requests, in/out lengths uniform in
#                   [100, 1024], ignore_eos): folio and Hugging Face transformers, on the default
#                   model (or its dummy-weight twin when the model is absent) and on a dummy-weight
#                   Llama-3.1-8B-shaped model.
#
# Worst case (every step at its limit) is 515 s. Hugging Face runs under a time budget and then
# reports the tokens it made in that time ("partial": true); the 8B model runs as batches of 64.
#
# Dry run: FOLIO_GPU_CHECK_DRY=1 runs every step here, without a GPU: the CUDA kernel table is the
# SIMT emulator's (FOLIO_CUDA_TABLE=simt.table:simt_kernels), sizes are tiny, the Hugging Face steps
# and the install's pip are skipped. tests/test_gpu_check_dry.py runs it in the default suite, so a
# real run fails only on what truly needs a GPU.
#
# Usage: OUT=/some/dir perf/gpu_check.sh      (PYTHON=python3, NUM_REQUESTS=256 overridable)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
PY=${PYTHON:-python3}
N=${NUM_REQUESTS:-256}
DRY=${FOLIO_GPU_CHECK_DRY:-0}
[ "$DRY" = 0 ] && DRY=""
mkdir -p "$OUT"
WORK=$(mktemp -d)
LOG="$OUT/gpu_check.log"
: >"$LOG"
T0=$(date +%s)
SCALE=1
if [ -n "$DRY" ]; then
  export FOLIO_CUDA_TABLE=simt.table:simt_kernels PYTHONPATH="$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
  export OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 FOLIO_SIMT_DEVICE_BYTES=$((1 << 30))
  N=${NUM_REQUESTS:-3}
  SCALE=3  # the emulator is slower than a GPU: limits x3, sizes tiny
fi

step() {  # step NAME LIMIT_SECONDS CMD...: run with a time limit, record rc and seconds
  local name=$1 limit=$(( $2 * SCALE )); shift 2
  local s e rc
  s=$(date +%s)
  echo "=== $name (limit ${limit}s, at +$((s - T0))s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  e=$(date +%s)
  echo "{\"rc\": $rc, \"seconds\": $((e - s)), \"limit\": $limit, \"timed_out\": $([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo true || echo false)}" >"$WORK/step_$name.json"
  echo "=== $name: rc=$rc in $((e - s))s" | tee -a "$LOG"
}

# environment
$PY - >"$WORK/env.json" 2>>"$LOG" <<'PYEOF'
import json, os, platform, subprocess
env = {"python": platform.python_version(), "dry_run": bool(os.environ.get("FOLIO_CUDA_TABLE"))}
for mod in ("numpy", "cupy", "torch", "transformers", "numba", "tokenizers", "safetensors"):
    try:
        env[mod] = __import__(mod).__version__
    except Exception as e:
        env[mod] = f"missing ({type(e).__name__})"
try:
    env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except Exception as e:
    env["nvidia_smi"] = str(e)
print(json.dumps(env))
PYEOF

install() {
  if [ -z "$DRY" ]; then
    local wheels=${FOLIO_WHEELS:-wheels}
    if [ -d "$wheels" ]; then
      $PY -m pip install -q --no-index --find-links "$wheels" "$wheels"/*.whl || true
    fi
    $PY -c "import folio" 2>/dev/null || \
      $PY -m pip install -q --no-deps --no-index --no-build-isolation -e . || return 1
  fi
  # warm the caches, both at once: NVRTC (every kernel of the table, into CuPy's disk cache; the
  # emulator's g++ builds in a dry run) and Numba (the CPU kernels the forward check compares with)
  $PY -c "from folio.kernels import get_kernels; get_kernels('cuda'); print('cuda kernels built')" &
  local nvrtc=$!
  $PY - <<'PYEOF' &
import numpy as np
from folio.kernels import get_kernels
from folio.model.attention import AttentionMetadata
from folio.model.config import ModelConfig
from folio.model.llama import LlamaForCausalLM
from folio.model.loader import allocate_kv_caches
from folio.model.weights import dummy_weights
cfg = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64,
                             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 64})
k = get_kernels("cpu")
m = LlamaForCausalLM(cfg, dummy_weights(cfg), k)
caches = allocate_kv_caches(cfg, 4, 16, k)
for T in (5, 1):  # a prefill and a decode: both code paths compiled
    md = AttentionMetadata(np.arange(T, dtype=np.int64), np.array([0, T], np.int32), np.array([T], np.int32),
                           np.array([[0, 1]], np.int32), T, T)
    m.forward(np.zeros(T, np.int64), np.arange(T, dtype=np.int64), md, caches, np.array([T - 1]))
print("numba kernels compiled")
PYEOF
  local numba=$!
  wait $nvrtc || return 1
  wait $numba || return 1
}
step install 120 bash -c "$(declare -f install); PY=$PY; DRY=$DRY; install"

if [ -n "$DRY" ]; then  # the same tests on the emulator
  step kernels 60 $PY -m pytest -q -p no:cacheprovider --junitxml="$WORK/kernels.xml" \
    tests/test_cuda_kernels.py tests/simt/test_mma.py
else
  step kernels 60 env FOLIO_TEST_CUDA=1 $PY -m pytest -q -p no:cacheprovider \
    --junitxml="$WORK/kernels.xml" tests/test_cuda_kernels.py tests/simt/test_mma.py tests/test_nvrtc.py
fi

step golden 60 $PY perf/gpu_check_golden.py --out "$WORK/golden.json" ${DRY:+--dry}

# the default model if it is here, else its dummy-weight twin (same shapes, same workload)
SMALL=smollm2-135m-instruct
$PY -c "from folio.model.registry import resolve_model; resolve_model('$SMALL')" >>"$LOG" 2>&1 || SMALL=smollm2-135m-dummy
echo "small model: $SMALL" | tee -a "$LOG"
# the CLI end to end, greedy (not in a dry run: the CLI builds the engine at its default sizes, whose
# 2048-token profiling step takes minutes on the emulator; golden covers LLM(device="cuda"))
if [ "$SMALL" = smollm2-135m-instruct ] && [ -z "$DRY" ]; then
  step cli 25 bash -c "$PY -m folio.cli generate --device cuda --prompt 'The capital of France is' \
    --max-tokens 16 --json >'$WORK/cli.json'"
fi

if [ -n "$DRY" ]; then
  step bench_folio_small 45 $PY perf/gpu_check_bench.py --engine folio --model smollm2-2l-dummy \
    --num-requests "$N" --min-len 8 --max-len 16 --max-num-seqs 4 --max-num-batched-tokens 64 \
    --out "$WORK/bench_folio_small.json"
else
  step bench_folio_small 45 $PY perf/gpu_check_bench.py --engine folio --model "$SMALL" --num-requests "$N" \
    --out "$WORK/bench_folio_small.json"
  step bench_hf_small 30 $PY perf/gpu_check_bench.py --engine hf --model "$SMALL" --num-requests "$N" \
    --time-budget 15 --out "$WORK/bench_hf_small.json"
  step bench_folio_8b 120 $PY perf/gpu_check_bench.py --engine folio --model llama-3.1-8b-dummy \
    --num-requests "$N" --out "$WORK/bench_folio_8b.json"
  step bench_hf_8b 60 $PY perf/gpu_check_bench.py --engine hf --model llama-3.1-8b-dummy --num-requests "$N" \
    --hf-batch 64 --time-budget 25 --out "$WORK/bench_hf_8b.json"
fi

# one JSON with everything
$PY - "$WORK" "$OUT/gpu_check.json" "$SMALL" "$(( $(date +%s) - T0 ))" <<'PYEOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET
work, out, small, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except Exception as e:
        return {"missing": f"{type(e).__name__}: {e}"}
res = {"total_seconds": total, "small_model": small, "env": load(os.path.join(work, "env.json")), "steps": {}}
for p in sorted(glob.glob(os.path.join(work, "step_*.json"))):
    name = os.path.basename(p)[5:-5]
    res["steps"][name] = load(p)
    r = os.path.join(work, name + ".json")
    if os.path.exists(r):
        res["steps"][name]["result"] = load(r)
try:
    root = ET.parse(os.path.join(work, "kernels.xml")).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    res["steps"].setdefault("kernels", {})["result"] = {
        k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
        "time": float(suite.get("time", 0)), "failed": failed}
except Exception as e:
    res["steps"].setdefault("kernels", {})["result"] = {"missing": str(e)}
with open(out, "w") as f:
    json.dump(res, f, indent=1)
summary = {n: (s.get("rc"), s.get("seconds")) for n, s in res["steps"].items()}
print(json.dumps({"total_seconds": total, "steps": summary}))
for n in ("bench_folio_small", "bench_hf_small", "bench_folio_8b", "bench_hf_8b"):
    r = res["steps"].get(n, {}).get("result", {})
    if r:
        print(n, r.get("output_tokens_per_s"), "output tok/s", "(partial)" if r.get("partial") else "", r.get("error", ""))
PYEOF
rm -rf "$WORK"
