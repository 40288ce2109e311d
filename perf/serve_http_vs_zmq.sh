#!/usr/bin/env bash
# The same `folio bench serve` workload through both doors of one `folio serve`, in one run:
# ZeroMQ (AsyncClient) and HTTP (/v1/completions, SSE), in the order zmq, http, http, zmq so that a
# drift of the machine's load shows up instead of favouring one side. Prints each summary and the load.
#   OUT=dir perf/serve_http_vs_zmq.sh [extra bench flags]
# SERVE_ARGS adds folio serve flags; with the test suite's EchoRunner (no model: next id = last id + 1)
# the difference between the two doors is the HTTP layer's own cost:
#   PYTHONPATH=tests SERVE_ARGS="--worker-runner support.ipc_fake_runner:EchoRunner" perf/serve_http_vs_zmq.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-/tmp/folio-http-vs-zmq}
mkdir -p "$OUT"
rm -f "$OUT/serve.log"
ADDR="ipc://$OUT/serve.sock"
BENCH=(--num-prompts 16 --min-input-len 32 --max-input-len 128 --min-output-len 16 --max-output-len 32 "$@")
# prefix caching off: the same prompts run four times, and cached prefixes would favour the later runs
"$PY" -m folio serve --device cpu --address "$ADDR" --port 0 --max-model-len 1024 --no-enable-prefix-caching \
  ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER || true' EXIT
until grep -qs "ready on" "$OUT/serve.log"; do
  kill -0 $SERVER 2>/dev/null || { cat "$OUT/serve.log"; exit 1; }
  sleep 1
done
URL=$(grep -o 'http://[^ ]*' "$OUT/serve.log" | head -1)
lscpu | grep "Model name"
for i in 1 2 3 4; do
  case $i in 1|4) BACKEND=(--backend folio --address "$ADDR");; *) BACKEND=(--backend openai --base-url "$URL");; esac
  echo "== run $i: ${BACKEND[1]}  (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  "$PY" -m folio bench serve "${BACKEND[@]}" "${BENCH[@]}" --result-file "$OUT/run$i.json"
done
