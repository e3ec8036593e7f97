# The two commands of the README. Each runs the idempotent set-up first.
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python

.PHONY: setup demo test lint
setup:
	SLURM_DLRM_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(VENV)/bin/slurm-dlrm demo

lint: setup
	$(VENV)/bin/ruff check slurm_dlrm tests benchmarks
	$(VENV)/bin/mypy

test: lint
	CI=$${CI:-} $(PY) -m pytest -q --durations=25
