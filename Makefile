# The two set-up commands: `make demo` (a real training run) and `make test`. Each creates .venv if missing.
PYTHON ?= python3
VENV ?= .venv
# CPU build of PyTorch; on a GPU machine use e.g. `make TORCH_SPEC=torch==2.11.0 test`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
# What the demo needs (meshtron, torch, and matplotlib for `meshtron plot`), then the test tools on top for `make test`.
STAMP := $(VENV)/.meshtron-installed
TEST_STAMP := $(VENV)/.meshtron-test-installed

.PHONY: demo test lint bench clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[plot]"
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $(TEST_STAMP)

demo: $(STAMP)
	$(VENV)/bin/meshtron train --config configs/demo.toml --nproc 2
	@echo "meshtron is installed in $(VENV): 'source $(VENV)/bin/activate' puts it on PATH (or run $(VENV)/bin/meshtron)"

# ruff (lint, import order, format; [tool.ruff] in pyproject.toml) and the layer contract of CONTRIBUTING.md
# ([tool.importlinter]), no import cycle between modules (tools/check_import_cycles.py, which prints each one), and
# mypy over meshtron/ ([tool.mypy]: its level and what comes next; its cache is .mypy_cache).
# `$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .` repairs most of what ruff finds.
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tools/check_import_cycles.py
	$(PY) -m mypy

# Two pytest workers (tests/conftest.py says how the modules are spread); `$(PY) -m pytest tests/...` runs in one.
test: $(TEST_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder --durations=15

bench: $(TEST_STAMP)
	$(PY) bench/throughput.py

clean-venv:
	rm -rf $(VENV)
