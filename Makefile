# Set-up and checks for kvx. `make demo` runs the main job, `make test` the whole suite;
# both create .venv and install everything they need on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-stamp

.PHONY: venv demo test lint typecheck pytest system-deps clean

# torch goes in first and pinned (the CPU build lies on local disk; an unpinned torch pulls a
# multi-GB CUDA build), and every later install is constrained to it.
$(STAMP): pyproject.toml constraints.txt examples/kvx-example-connector/pyproject.toml layouts/_native.c
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch
	$(PIP) install --quiet -c constraints.txt -e '.[dev,redis,nixl]'
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

# Real services the tests start themselves (never mocked): redis-server from Debian.
system-deps:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (needed by the storage tests)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null || { echo "redis-server is missing and could not be installed" >&2; exit 1; }

pytest: venv system-deps
	$(PY) -m pytest

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
