# Two commands set up everything on a fresh machine (Python 3.11 + pip):
#   make demo   install, then run the main job on the embedded SmolLM2 target
#   make test   install, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test
setup:
	EYAS_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	EYAS=$(VENV)/bin/eyas bash scripts/demo.sh

test: setup
	$(PY) -m pytest -q
