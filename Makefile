# On a fresh machine (Python 3.11 + pip) each command installs everything first:
#   make demo        install, then run the main job on the embedded SmolLM2 target
#   make test        install, then run the whole test suite (every tier; CI runs this)
#   make test-fast   install, then run the unit tier only (under a minute on 2 cores)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest -q

.PHONY: setup demo test test-fast
setup:
	EYAS_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	EYAS=$(VENV)/bin/eyas bash scripts/demo.sh

test: setup
	$(PYTEST)

test-fast: setup
	$(PYTEST) -m unit
