# Set-up is one venv in .venv: torch 2.13.0 first (the CPU wheel on disk; an unpinned torch
# would pull a multi-GB CUDA build) and Flower 1.41 (1.42 does not install here), then the
# package and its test extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-slow bench bench-peers clean

$(STAMP): pyproject.toml lab/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0 'flwr[simulation]==1.41.0'
	$(BIN)/pip install --disable-pip-version-check -q -e '.[test]' -e ./lab
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/stocfl run configs/default.toml

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/stocfl-lab bench --out benchmarks/results.json

bench-peers: $(STAMP)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[bench]' -e './lab[peers]'
	$(BIN)/stocfl-lab bench --peers --out benchmarks/peers.json

clean:
	rm -rf $(VENV) runs
