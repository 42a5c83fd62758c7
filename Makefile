# Set-up and checks for kvx. `make demo` runs the main job, `make test` the whole suite;
# both create .venv and install everything they need on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test lint typecheck pytest clean

# torch goes in first and pinned (the CPU build lies on local disk; an unpinned torch pulls a
# multi-GB CUDA build), and every later install is constrained to it.
$(STAMP): pyproject.toml constraints.txt examples/kvx-example-connector/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	$(PIP) install --quiet --no-deps -e examples/kvx-example-connector
	rm -rf *.egg-info examples/*/*.egg-info  # build leftovers; stale entry points would shadow the venv's
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(VENV)/bin/kvx demo

lint: venv
	$(VENV)/bin/ruff check .

typecheck: venv
	$(VENV)/bin/mypy

pytest: venv
	$(PY) -m pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
