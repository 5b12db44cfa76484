# Two entry points: `make run` (set up + the CPU default job) and `make test` (set up + the test suite).
# The venv is created on first use; torch is pinned through constraints.txt so pip never pulls a CUDA build.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
CONFIG  ?= configs/digits_cpu.yaml
ARGS    ?=

.PHONY: setup setup-extras run prompts lint test test-fast test-slow test-dist bench clean

# Two stamps: .installed = the core (what `make run`'s default job uses: the built-in DiT and the digit classifier),
# .installed-extras = every extra on top (what `make test` needs). A job that needs an extra the core lacks says
# which one on one line (jagg_scale/extras.py).
$(BIN)/.installed: pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e .
	touch $@

# DeepSpeed's CPU collectives (its shm_comm extension) are JIT-compiled on first use (~40 s, cached in
# ~/.cache/torch_extensions): built here, with the install, so that the first DeepSpeed test does not spend it
# (the venv's bin first on PATH, as tests/conftest.py puts it: torch builds with the first `ninja` there, and the
# venv's and the system's keep build logs that each rebuild the op from scratch)
$(BIN)/.installed-extras: $(BIN)/.installed
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,tools,models,rewards,data,deepspeed,mpi,server]'
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
		> /dev/null
	touch $@

setup: $(BIN)/.installed
setup-extras: $(BIN)/.installed-extras

# run.resume=auto: a second `make run` continues the run in the config's output_dir (a finished one just prints its
# summary again) instead of being refused for replacing it; ARGS come after, so they can override it
# (ARGS="run.resume=none run.overwrite=true" trains it again from step 0).
run: setup
	$(BIN)/jagg-train $(CONFIG) run.resume=auto $(ARGS)

# The production configs' prompt sets (Flow-GRPO's, DanceGRPO's), at pinned commits and digests, into the git-ignored
# data/prompt_sets/ they read (jagg_scale/data/fetch.py; the default job needs none).
prompts: setup
	$(BIN)/jagg-prompts fetch

# ruff over the package, the tools and the tests (its config: pyproject.toml)
lint: setup-extras
	$(BIN)/ruff check jagg_scale tools tests

# What CI runs (.ci/run): the linter, then the whole suite with every optional extra required (a missing one fails the
# session instead of skipping tests: tests/extras.py), in one pytest-xdist worker per core (TEST_WORKERS; each runs
# one torch thread: tests/conftest.py). Markers (pyproject.toml): slow = >= ~5 s alone, dist = several processes or
# DeepSpeed.
# Every test target runs in those workers and names its 15 slowest tests at the end.
TEST_WORKERS ?= auto
PYTEST  = $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=15
test: lint
	JAGG_REQUIRE_EXTRAS=1 $(PYTEST) tests

# The inner loop: everything but slow and dist tests.
test-fast: setup-extras
	$(PYTEST) -m "not slow and not dist" tests

# What test-fast leaves out (test-fast + test-slow = test).
test-slow: setup-extras
	$(PYTEST) -m "slow or dist" tests

# The multi-process tests only (torchrun, deepspeed, mpirun).
test-dist: setup-extras
	$(PYTEST) -m dist tests

bench: setup-extras
	$(BIN)/python -m tools.bench

clean:
	rm -rf $(VENV) *.egg-info
