# make run    : set up .venv with the formula, its charts and the web app (no torch) and
#              estimate the default job
# make test   : add the development tools (torch CPU build, transformers, ...) and run the tests
# make lint   : ruff and the import-linter layering contracts
# make bench  : rerun every CPU benchmark and rewrite benchmarks/results/
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench bench-quick wheel-check setup clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# the formula CLI (pydantic, typer, rich, PyYAML, platformdirs) and what the README tour's
# formula commands use: matplotlib (--html, --plot) and fastapi + uvicorn (serve); no torch
$(VENV)/.base: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[plot,web]'
	touch $@

$(VENV)/.dev: pyproject.toml requirements-dev.txt | $(BIN)/python
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(VENV)/.base $@

setup: $(VENV)/.dev

run: $(VENV)/.base
	$(BIN)/vramplan

test: $(VENV)/.dev
	$(BIN)/python -m pytest -q

lint: $(VENV)/.dev
	$(BIN)/ruff check vramplan benchmarks
	$(BIN)/lint-imports

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/run_all.py

bench-quick: $(VENV)/.dev
	$(BIN)/python benchmarks/run_all.py --quick

# pip install of the wheel without extras in a fresh venv gives a working formula CLI
wheel-check: $(BIN)/python
	rm -rf build/wheel build/venv-wheel
	$(BIN)/pip wheel -q --no-deps -w build/wheel .
	$(PY) -m venv build/venv-wheel
	build/venv-wheel/bin/pip install -q build/wheel/vramplan-*.whl
	build/venv-wheel/bin/vramplan estimate llama-3.2-1b --json > build/wheel-estimate.json
	build/venv-wheel/bin/vramplan models > /dev/null
	build/venv-wheel/bin/python -c "import json, sys; d = json.load(open('build/wheel-estimate.json')); sys.exit(d['peak_allocated'] <= 0)"
	build/venv-wheel/bin/python -c "import sys, vramplan; vramplan.estimate(vramplan.Job()); sys.exit('torch' in sys.modules)"

clean:
	rm -rf $(VENV) build *.egg-info
