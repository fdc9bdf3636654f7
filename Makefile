# `make test` and `make report` work on a fresh clone with only Python 3.10+ present:
# each creates .venv, installs attnlib with the extras it needs, then runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# Extra arguments for the report runner, e.g. make report ARGS="--only memory -p n=8192"
ARGS   ?=

.PHONY: test report lab venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstalled whenever pyproject.toml (the single source of the dependencies) changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,report]'
	touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	$(BIN)/python -m pytest

report: $(VENV)/.installed
	$(BIN)/python -m attnlib report $(ARGS)

$(VENV)/.lab-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test,report,lab]'
	touch $@

lab: $(VENV)/.lab-installed
	$(BIN)/jupyter lab notebooks/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
