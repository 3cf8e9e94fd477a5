# The two commands of the README: `make demo` (the main job) and `make test` (the test suite).
# Both create the virtual environment first; that step reruns only when its inputs changed.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test setup bench

$(STAMP): requirements.txt pyproject.toml scripts/setup_venv.sh
	bash scripts/setup_venv.sh

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Benchmarks (not part of the tests; figures go to artifacts/ and BENCHMARKS.md says how they were made).
# The real-server balancer run (experiments.bench.balancer_servers) and the copy probe take longer: run them alone.
bench: $(STAMP)
	mkdir -p artifacts
	$(PY) -m experiments.bench.learner --json artifacts/bench_learner.json
	$(PY) -m experiments.bench.engine --json artifacts/bench_engine.json
	$(PY) -m experiments.bench.sandbox --json artifacts/bench_sandbox.json
	$(PY) -m experiments.bench.balancer --json artifacts/bench_balancer.json
