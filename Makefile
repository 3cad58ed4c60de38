# make run   : set up a virtual environment and estimate the built-in default job
# make test  : set up the same environment and run the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test setup bench clean

$(BIN)/vramplan: pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-dev.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

setup: $(BIN)/vramplan

run: setup
	$(BIN)/vramplan

test: setup
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
