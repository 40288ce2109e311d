#!/usr/bin/env bash
# perf/gpu_check.sh: everything folio checks on one NVIDIA GPU, in one run of at most 8 minutes on
# an H100 or an H200 with no network and nothing to install (the lent machine: a Python 3.12 venv with torch,
# transformers and cupy-cuda13x, numpy, numba, tokenizers; no pyzmq, no gguf, no model files;
# only the repository travels, so nothing here needs a model file). Results: $OUT/gpu_check.json
# (one object: environment, each step's exit status and seconds, and its results; rewritten after
# every step, so a run cut short keeps what finished) and $OUT/gpu_check.log (all output).
#
# Steps (each under its own time limit, so one slow step cannot sink the rest):
#   install         a venv of its own with --system-site-packages (plus the calling interpreter's
#                   own site-packages, when that is a venv itself) and folio installed into it with
#                   `pip install --no-deps --no-index --no-build-isolation -e .` (wheels of missing
#                   dependencies from $FOLIO_WHEELS, default ./wheels, if present; if pip cannot
#                   build, a .pth file pointing at the checkout: the same editable install by hand);
#                   then every CUDA kernel compiled by NVRTC into CuPy's disk cache
#   kernels         every CUDA kernel test against kernels/reference.py on the GPU, the mma.sync
#                   fragment layout check, NVRTC compiles (FOLIO_TEST_CUDA=1 pytest ...)
#   golden          perf/gpu_check_golden.py: the GPU forward checked op by op against the spec;
#                   CUDA graphs against eager decode; folio against Hugging Face transformers on
#                   the GPU with the same random bf16 weights (logits within a bound derived from
#                   bf16 rounding and depth, greedy ids equal up to a near tie)
#   kernel_bench    perf/gpu_kernel_bench.py: each kernel of a Llama-3.1-8B decode layer (and the
#                   lm_head and sampler) at batch 128 and 256, context 300, timed from a CUDA graph:
#                   achieved GB/s and TFLOPS against the card's peaks (perf/gpu_model.py's bytes
#                   and FLOPs, the card by nvidia-smi's name)
#   bench_*         throughput on one workload (NUM_REQUESTS=256 requests, prompt and output lengths
#                   uniform in [32, 256], ignore_eos), folio and Hugging Face transformers, each over
#                   the whole workload at the same concurrency (256), on a dummy-weight
#                   SmolLM2-135M-shaped model and a dummy-weight Llama-3.1-8B-shaped one; folio's
#                   warm-up captures every CUDA-graph bucket; transformers' import stays out of its
#                   timed region, and its generation stops in time for its step's limit
#   model           perf/gpu_model.py: the roofline cost model of each workload on the card that ran
#                   (H100 SXM or H200 by nvidia-smi's name; both when another), per kernel of a
#                   decode step at batch 128 and 256 and for the whole workload, printed beside the
#                   bench steps' measured output tok/s and decode step times (no GPU needed)
#
# Worst case (every step at its limit, and killed 5 s after it): 455 s.
#
# Dry run: FOLIO_GPU_CHECK_DRY=1 runs every step here, without a GPU: the CUDA kernel table is the
# SIMT emulator's (FOLIO_CUDA_TABLE=simt.table:simt_kernels), sizes are tiny, the limits x3, the
# Hugging Face benchmark steps are left out, the golden step's hf_compare runs transformers on the
# CPU and, where torch is missing, is reported as {"skipped": "no torch"} (no comparison is made).
# The install step runs as on the device.
# tests/perf/test_gpu_check_dry.py runs it in the default suite, so a real run fails only on what truly
# needs a GPU.
#
# Usage: OUT=/some/dir perf/gpu_check.sh      (PYTHON=python3, NUM_REQUESTS=256 overridable)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
PY=${PYTHON:-python3}
BASE_PY=$PY
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

# one JSON with everything so far (stdlib only): written after every step
cat >"$WORK/assemble.py" <<'PYEOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET
work, out, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except Exception as e:
        return {"missing": f"{type(e).__name__}: {e}"}
res = {"total_seconds": total, "env": load(os.path.join(work, "env.json")), "steps": {}}
for p in sorted(glob.glob(os.path.join(work, "step_*.json")), key=os.path.getmtime):
    name = os.path.basename(p)[5:-5]
    res["steps"][name] = load(p)
    r = os.path.join(work, name + ".json")
    if os.path.exists(r):
        res["steps"][name]["result"] = load(r)
if os.path.exists(os.path.join(work, "install_mode")):
    res["env"]["install"] = open(os.path.join(work, "install_mode")).read().strip()
if "kernels" in res["steps"]:
    try:
        root = ET.parse(os.path.join(work, "kernels.xml")).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                  if c.find("failure") is not None or c.find("error") is not None]
        res["steps"]["kernels"]["result"] = {
            k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | {
            "time": float(suite.get("time", 0)), "failed": failed}
    except Exception as e:
        res["steps"]["kernels"]["result"] = {"missing": str(e)}
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(res, f, indent=1)
os.replace(tmp, out)
if len(sys.argv) > 4:  # the final summary
    print(json.dumps({"total_seconds": total, "steps": {n: (s.get("rc"), s.get("seconds")) for n, s in res["steps"].items()}}))
    for n in ("bench_folio_small", "bench_hf_small", "bench_folio_8b", "bench_hf_8b"):
        r = res["steps"].get(n, {}).get("result", {})
        if r:
            print(n, r.get("output_tokens_per_s"), "output tok/s", "(partial)" if r.get("partial") else "", r.get("error", ""))
    for B, rows in res["steps"].get("kernel_bench", {}).get("result", {}).get("batches", {}).items():
        for r in rows:
            if r.get("kernel") in ("paged_attention decode", "gate_up_proj", "sample") and "us" in r:
                print(f"kernel {r['kernel']} batch {B}: {r['us']} us, {100 * r['fraction_of_hbm']:.0f}% of HBM, "
                      f"{100 * r['fraction_of_bf16']:.0f}% of bf16")
    for model, m in res["steps"].get("model", {}).get("result", {}).get("models", {}).items():
        for card, c in m.items():
            if isinstance(c, dict) and "workload" in c:
                got = c.get("measured", {})
                print(f"model {model} on {card}: bound {c['workload']['ideal']['output_tokens_per_s']:.0f} output tok/s,"
                      f" measured {got.get('output_tokens_per_s')} ({100 * got.get('fraction_of_ideal_bound', 0):.1f}%)")
PYEOF
assemble() { $BASE_PY "$WORK/assemble.py" "$WORK" "$OUT/gpu_check.json" "$(( $(date +%s) - T0 ))" "$@" 2>>"$LOG"; }

step() {  # step NAME LIMIT_SECONDS CMD...: run with a time limit, record rc and seconds, rewrite the JSON
  local name=$1 limit=$(( $2 * SCALE )); shift 2
  local s e rc
  s=$(date +%s)
  echo "=== $name (limit ${limit}s, at +$((s - T0))s): $*" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  e=$(date +%s)
  echo "{\"rc\": $rc, \"seconds\": $((e - s)), \"limit\": $limit, \"timed_out\": $([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo true || echo false)}" >"$WORK/step_$name.json"
  echo "=== $name: rc=$rc in $((e - s))s" | tee -a "$LOG"
  assemble
}

# environment
$PY - >"$WORK/env.json" 2>>"$LOG" <<'PYEOF'
import json, os, platform, subprocess
env = {"python": platform.python_version(), "dry_run": bool(os.environ.get("FOLIO_CUDA_TABLE"))}
for mod in ("numpy", "cupy", "torch", "transformers", "numba", "tokenizers", "safetensors", "pytest", "zmq", "gguf"):
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
assemble

VENV="$WORK/venv"
install() {
  # a venv that sees the packages of the interpreter that runs this script: --system-site-packages
  # reaches the base installation's, the .pth the calling venv's own (when PYTHON is a venv)
  $PY -m venv --system-site-packages --without-pip "$VENV" || return 1
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  $PY -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/folio-gpu-check-parent.pth" || return 1
  local wheels=${FOLIO_WHEELS:-wheels}
  if [ -d "$wheels" ]; then
    "$VENV/bin/python" -m pip install -q --no-index --find-links "$wheels" "$wheels"/*.whl || true
  fi
  if "$VENV/bin/python" -m pip install -q --no-deps --no-index --no-build-isolation -e .; then
    echo pip >"$WORK/install_mode"
  else  # no build backend here: the editable install by hand
    echo "$PWD" >"$site/folio-gpu-check-src.pth"
    echo "pth (pip install failed)" >"$WORK/install_mode"
  fi
  (cd / && "$VENV/bin/python" -c "import folio; print('folio from', folio.__file__)") || return 1
  # warm CuPy's disk cache: every kernel of the table compiled by NVRTC (the emulator's g++ builds
  # in a dry run, with Numba's CPU kernels for the CPU reference the dry run compares with)
  "$VENV/bin/python" -c "from folio.kernels import get_kernels; get_kernels('cuda'); print('cuda kernels built')" &
  local nvrtc=$!
  local numba=""
  if [ -n "$DRY" ]; then
    "$VENV/bin/python" - <<'PYEOF' &
import numpy as np
from folio.kernels import get_kernels
from folio.model.attention_metadata import AttentionMetadata
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
    numba=$!
  fi
  wait $nvrtc || return 1
  [ -z "$numba" ] || wait $numba || return 1
}
step install 55 bash -c "$(declare -f install); PY=$PY; DRY=$DRY; VENV=$VENV; WORK=$WORK; install"
if [ -x "$VENV/bin/python" ] && (cd / && "$VENV/bin/python" -c "import folio") >>"$LOG" 2>&1; then
  PY=$VENV/bin/python
else  # the install failed: go on from the checkout (what still runs is still reported)
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "the install step did not make folio importable: the later steps run from the checkout (PYTHONPATH)" | tee -a "$LOG"
fi

if [ -n "$DRY" ]; then  # the same tests on the emulator
  step kernels 60 $PY -m pytest -q -p no:cacheprovider --junitxml="$WORK/kernels.xml" \
    tests/kernels/test_cuda_kernels.py tests/simt/test_mma.py
else
  step kernels 60 env FOLIO_TEST_CUDA=1 $PY -m pytest -q -p no:cacheprovider \
    --junitxml="$WORK/kernels.xml" tests/kernels/test_cuda_kernels.py tests/simt/test_mma.py tests/kernels/test_nvrtc.py
fi

step golden 75 $PY perf/gpu_check_golden.py --out "$WORK/golden.json" ${DRY:+--dry}

step kernel_bench 60 $PY perf/gpu_kernel_bench.py --out "$WORK/kernel_bench.json" ${DRY:+--dry}

if [ -n "$DRY" ]; then
  step bench_folio_small 25 $PY perf/gpu_check_bench.py --engine folio --model smollm2-2l-dummy \
    --num-requests "$N" --min-len 8 --max-len 16 --max-num-seqs 4 --max-num-batched-tokens 64 \
    --out "$WORK/bench_folio_small.json"
else
  W="--num-requests $N --min-len 32 --max-len 256 --max-num-seqs 256"
  step bench_folio_small 25 $PY perf/gpu_check_bench.py --engine folio --model smollm2-135m-dummy $W \
    --out "$WORK/bench_folio_small.json"
  step bench_hf_small 30 $PY perf/gpu_check_bench.py --engine hf --model smollm2-135m-dummy $W \
    --step-limit 30 --out "$WORK/bench_hf_small.json"
  step bench_folio_8b 35 $PY perf/gpu_check_bench.py --engine folio --model llama-3.1-8b-dummy $W \
    --out "$WORK/bench_folio_8b.json"
  step bench_hf_8b 50 $PY perf/gpu_check_bench.py --engine hf --model llama-3.1-8b-dummy $W \
    --step-limit 50 --out "$WORK/bench_hf_8b.json"
fi

step model 20 $PY perf/gpu_model.py --card auto --measured "$OUT/gpu_check.json" --json "$WORK/model.json"

assemble summary
rm -rf "$WORK"
