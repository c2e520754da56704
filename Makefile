# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# Both create the virtual environment on first use (VENV, default .venv).
VENV ?= .venv
# Where `make run` trains; running it again resumes from the last checkpoint.
WORKDIR ?= workdir/arith_tiny
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run demo test lint format bench lab

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m jaxcorr.main --config=configs/arith_tiny.py --workdir=$(WORKDIR)

demo: $(STAMP)
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
	$(PY) bench/train.py

lab: $(STAMP)
	$(PY) -m jaxcorr.lab --out=docs/mismatch_lab
