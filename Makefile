# The front door: `make demo`, `make test`. Each installs what it needs first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test build-demo-model clean

install: $(STAMP)

# Re-runs only when the dependency list or this file changes; otherwise `make install` is instant.
$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: install
	$(BIN)/reinforge demo

test: install
	$(BIN)/python -m pytest

build-demo-model: install
	$(BIN)/python scripts/build_demo_model.py

clean:
	rm -rf $(VENV) runs .pytest_cache
