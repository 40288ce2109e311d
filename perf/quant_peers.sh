#!/usr/bin/env bash
# The figures of perf/quant_peers.md (issue 29's benchmarks), in one sitting: single-stream
# prefill/decode (`folio bench latency`) and 16- and 64-request throughput (`folio bench
# throughput`) on the Llama-3.2-1B-shaped Q4_K_M and Q8_0 files at 1 and 2 threads, then the
# Llama-3.1-8B-shaped Q4_K_M (load, peak RSS, a short decode at all threads).
#
#   perf/.venv-convert/bin/python perf/make_gguf_models.py 1b        # the files (see its docstring)
#   perf/.venv-convert/bin/python perf/make_gguf_models.py 8b --quants Q4_K_M
#   FOLIO_LLAMA_CPP_BIN=... perf/quant_peers.sh                       # writes $OUT/*.{txt,json}
#
# FOLIO_ARGS=--no-folio (the default) takes llama-server's figures alone; set FOLIO_ARGS= once
# folio serves GGUF files (--model FILE.gguf) to run both engines on each file. THREADS lists the
# thread counts (default "1 N", N = every core), STEPS the parts to run (default all: latency
# throughput16 8b throughput64, in that order: the most wanted first).
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=${MODELS:-${FOLIO_HOME:-$HOME/.cache/folio}/bench-models}
OUT=${OUT:-perf/quant_peers}
FOLIO=${FOLIO:-.venv/bin/folio}
FOLIO_ARGS=${FOLIO_ARGS---no-folio}
ALL=$(nproc)
THREADS=${THREADS:-"1 $ALL"}
STEPS=${STEPS:-"latency throughput16 8b throughput64"}
mkdir -p "$OUT"

run() {  # run NAME ARGS...: one command, its text in $OUT/NAME.txt, its figures in $OUT/NAME.json
    local name=$1; shift
    echo "== $name: $FOLIO $* (load $(cut -d' ' -f1 /proc/loadavg))"
    "$FOLIO" "$@" --no-progress --json "$OUT/$name.json" | tee "$OUT/$name.txt"
}

for step in $STEPS; do
    case $step in
    latency)
        for q in Q4_K_M Q8_0; do for t in $THREADS; do
            run "1b-$q-latency-t$t" bench latency --model "$MODELS/llama3.2-1b-random.$q.gguf" \
                --peer llama-cpp-server --threads "$t" --input-len 512 --output-len 128 --num-iters 3 $FOLIO_ARGS
        done; done ;;
    throughput16|throughput64)
        n=${step#throughput}
        for q in Q4_K_M Q8_0; do for t in $THREADS; do
            run "1b-$q-throughput$n-t$t" bench throughput --model "$MODELS/llama3.2-1b-random.$q.gguf" \
                --peer llama-cpp-server --threads "$t" --num-prompts "$n" $FOLIO_ARGS
        done; done ;;
    8b)
        run "8b-Q4_K_M-latency-t$ALL" bench latency --model "$MODELS/llama3.1-8b-random.Q4_K_M.gguf" \
            --peer llama-cpp-server --threads "$ALL" --input-len 128 --output-len 32 --num-iters 1 $FOLIO_ARGS ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
