# The two commands of the README:  `make demo` (main job)  and  `make test`  (the suite).
# Both create .venv and install everything on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch==2.13.0 is the CPU wheel this project is developed on; a GPU machine wants the CUDA
# build for its driver instead, e.g. `make test TORCH_SPEC=torch` (pulls several GB).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install demo check test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[torch,jax,train,dev]"
	touch $(STAMP)

# The main job on its built-in default: the parity report, then PyTorch and JAX trained side by
# side on the synthetic copy task (no files needed; about 2 minutes on 2 CPU cores).
demo: $(STAMP)
	$(BIN)/rosetta parity --preset tiny
	$(BIN)/rosetta train --backend torch jax --task copy --steps 400 --warmup 100 \
		--eval-every 200 --out runs/demo --overwrite

# Two pytest workers (pytest-xdist): the suite is one process per core on this project's 2-core
# machines. On a GPU give `make test TEST_WORKERS=0` (one process: JAX preallocates GPU memory).
# --dist worksteal: each worker starts on a contiguous half of the tests (the slowest modules first:
# parity_tests/conftest.py's SLOW_FIRST) and an idle one takes half of the other's queue.
# Each test's and module's wall and CPU seconds go to $(DURATIONS) (parity_tests/durations.py;
# `python -m parity_tests.durations $(DURATIONS)` prints the costliest modules).
TEST_WORKERS ?= 2
DURATIONS ?= .test-durations.json
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations-file=$(DURATIONS)

# The quick tier for a first minute (issue 56): the contract (config, checkpoint, the float64
# reference), every backend's parity with it over the config matrix, and the refusals of bad input
# (arguments, JSON, msgpack, checkpoints, output paths), with the code's layers; under 3 minutes cold on
# 2 cores (docs/testing.md). `make test` runs these and everything else.
CHECK_TESTS := $(addprefix parity_tests/test_,config.py checkpoint.py numpy_ref.py backend_parity.py \
	bad_inputs.py cli_args.py untrusted_json.py untrusted_msgpack.py output_paths.py marian_fields.py \
	edges_48.py layers.py structure.py)
check: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(CHECK_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
