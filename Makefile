# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch is pinned: this machine serves a local CPU wheel for 2.13.0; an unpinned torch pulls GBs of CUDA packages.

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m hasten.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(BIN)/hasten bench --model zoo:code-tiny --draft zoo:code-tiny-draft --out bench-out

clean:
	rm -rf $(VENV) bench-out
