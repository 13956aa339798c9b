# Set-up is one venv in .venv: torch 2.13.0 first (the CPU wheel on disk; an unpinned torch
# would pull a multi-GB CUDA build) and Flower 1.41, the gates' tools at the versions CI was
# green with (a newer ruff may lint or format otherwise), then the package with its test, docs
# and dev extras, and the lab. The package itself declares ranges.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-fast test-slow lint types docs check bench bench-peers bench-tables clean

$(STAMP): pyproject.toml lab/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q torch==2.13.0 'flwr[simulation]==1.41.0'
	$(BIN)/pip install --disable-pip-version-check -q ruff==0.17.6 mypy==2.4.1 mkdocs==1.6.1 mkdocs-material==9.8.2 \
		mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
	$(BIN)/pip install --disable-pip-version-check -q -e '.[test,docs,dev]' -e ./lab
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/stocfl run default

test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal

# the inner loop: no Flower processes, nothing slow
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist worksteal -m 'not slow and not flower and not long'

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# what CI runs (.ci/run)
check: lint types docs test

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

bench: $(STAMP)
	$(BIN)/stocfl-lab bench --out benchmarks/results.json

bench-tables: $(STAMP)
	$(BIN)/stocfl-lab bench --tables --again

bench-peers: $(STAMP)
	$(BIN)/pip install --disable-pip-version-check -q -e '.[bench]' -e './lab[peers]'
	$(BIN)/stocfl-lab bench --peers --out benchmarks/peers.json

clean:
	rm -rf $(VENV) runs site
