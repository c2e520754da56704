# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# Both create the virtual environment on first use (VENV, default .venv).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint format bench

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m jaxcorr.demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 -m 'not slow'

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check --no-cache .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) bench/losses.py
	$(PY) bench/model.py
	$(PY) bench/rollout.py
