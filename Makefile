# `make test` and `make report` work on a fresh clone with only Python 3.10+ present:
# each creates .venv, installs the project with the extras it needs, then runs.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: test report venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# One stamp per set of extras; reinstalled when pyproject.toml changes.
$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

venv: $(VENV)/.test-installed

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
