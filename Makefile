# `make demo` and `make test` each create .venv with pip and install what they need.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Two cores: one torch thread pool, sized on purpose, and tokenizers' own pool off.
export OMP_NUM_THREADS ?= 2
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
# The suite runs in two pytest-xdist workers, one test file each at a time: much of a test's time is one
# Python thread (tiny models, grammars, the scheduler), so two files at once fill both cores
# (417 s against ~700 s in one process on a 2-core VM). TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
# A hung test has its stacks printed at 240 s and fails at 300 s (pyproject's pytest-timeout), taking its worker with
# it; with no restarts xdist then ends the run, red, and the files not yet handed out do not run (a replaced worker
# once left xdist's file scheduler waiting forever). Whatever else hangs, timeout(1) ends the run within the hour
# (--foreground: Ctrl-C still reaches pytest).

.PHONY: demo test test-heavy lint bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the bounded range (2.13.0+cpu in the local cache), so nothing pulls a CUDA build.
	$(BIN)/pip install -q "torch>=2.6,<2.14"
	$(BIN)/pip install -q -e ".[test,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	timeout --foreground -k 60 3600 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --max-worker-restart 0
	$(BIN)/ruff check asyncpage kernels tests examples scripts
	$(BIN)/mypy asyncpage
	$(BIN)/lint-imports

# The default model through the slow paths (Triton interpreted, int4 load): ~3 minutes more.
test-heavy: $(STAMP)
	$(BIN)/python -m pytest -q -m heavy --timeout 1200 -o faulthandler_timeout=1100

lint: $(STAMP)
	$(BIN)/ruff check asyncpage kernels tests examples scripts
	$(BIN)/mypy asyncpage
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/asyncpage bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
