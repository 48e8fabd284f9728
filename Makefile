# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel this machine kind ships; a GPU box keeps the torch it already has.
TORCH_CPU ?= torch==2.13.0

.PHONY: install demo lint format test test-unit clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@if python3 -c "import torch" 2>/dev/null; then \
		echo "torch found on the system python: reusing it"; python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV) && $(PIP) install -q $(TORCH_CPU); \
	fi
	# torch is installed first so nothing below can pull a CUDA build; DeepSpeed compiles against that torch.
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation 'deepspeed>=0.19'
	$(PIP) install -q -e '.[dev,deepspeed,qlora]'
	@touch $@

# DEMO_FLAGS: extra `phalanx train` flags (the test suite shortens the demo with them).
demo: install
	$(PY) -m phalanx train configs/demo.yaml $(DEMO_FLAGS)

# Lint and format are checked before the tests (CI runs `make test`); `make format` rewrites in place.
lint: install
	$(PY) -m ruff check src tests benchmarks scripts
	$(PY) -m ruff format --check src tests benchmarks scripts

format: install
	$(PY) -m ruff check --fix src tests benchmarks scripts
	$(PY) -m ruff format src tests benchmarks scripts

# Two workers (pytest-xdist), each taking a whole test file at a time: the launch-heavy tests are
# seconds of single-threaded imports and waits each, so two at once fill the two cores a CI machine has
# (22 -> 18 minutes there; 17 with one thread per test process, tests/conftest.py). TEST_WORKERS=0 runs them one
# by one in this process.
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The fast tier: one process, no launched ranks, no generated scripts run (a few minutes on 2 cores).
test-unit: install
	$(PY) -m pytest -q -m "not distributed and not system"

clean:
	rm -rf $(VENV) runs .pytest_cache
