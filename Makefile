# `make test` and `make report` work on a fresh clone with only Python 3.10+ present:
# each creates .venv, installs attnlib with the extras it needs, then runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Extra arguments for the report runner, e.g. make report ARGS="--only memory -p n=8192"
ARGS   ?=

.PHONY: test test-fast report report-full lab venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstalled whenever pyproject.toml (the single source of the dependencies) changes.
# --no-compile: pip byte-compiles every module of every package it installs (torch's thousands):
# 47 s of install against 17 s (2-core AMD EPYC, pip's cache warm); the modules a run imports
# are compiled when first imported instead (~6 s for torch, dask, matplotlib, papermill), and
# kept: make writes bytecode (below). A process started outside make where
# PYTHONDONTWRITEBYTECODE is set compiles what it imports each time.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test,report]'
	touch $@

venv: $(VENV)/.installed

# The whole suite, on every core (pytest-xdist; a test file stays on one worker, so a
# module's cluster or quick reports start once), then the few tests that measure the
# machine's own load, alone. Files are handed out longest first (tests/conftest.py's
# LONGEST_FIRST; xdist's default reorder hands out the files with the most tests first, which
# left the notebook modules, few tests and minutes long, to the end).
# One worker per core, so each worker's BLAS and torch keep to one thread: their spinning
# OpenMP threads on cores the other worker holds took twice the CPU (measured on 4 files:
# 136 s against 61 s of user time, the same tests passing).
ONE_THREAD := OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1

# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set (into the git-ignored
# __pycache__/): without it every pytest process rewrote the asserts of all ~350 test and
# attnlib modules again (attnlib's pytest plugin puts the package under assertion rewriting;
# collection 11.5 s -> 7.0 s with the cache), and every kernel, cluster worker and fresh
# process compiled attnlib again.
export PYTHONDONTWRITEBYTECODE :=

# The serial part collects only the files that hold serial tests (collecting the whole suite
# again, doctests included, took 10-21 s for a handful of tests).
SERIAL_FILES = $(shell grep -l "mark.serial" tests/test_*.py)

test: $(VENV)/.installed
	$(ONE_THREAD) $(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder -m "not serial"
	$(BIN)/python -m pytest -m serial -q $(SERIAL_FILES)

# The inner loop: everything not marked slow (the notebooks, clusters, long sizes).
test-fast: $(VENV)/.installed
	$(ONE_THREAD) $(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder -m "not slow and not serial" -q

# The evidence in minutes: every notebook at its defaults, into reports/.
report: $(VENV)/.installed
	$(BIN)/python -m attnlib report $(ARGS)

# The measurements expensive by nature (long scans, the long cluster run): reports/full/.
report-full: $(VENV)/.installed
	$(BIN)/python -m attnlib report --full $(ARGS)

$(VENV)/.lab-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet --no-compile -e '.[test,report,lab]'
	touch $@

lab: $(VENV)/.lab-installed
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
