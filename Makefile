# Two commands set up everything on a fresh machine (Python 3.11 + pip):
#   make demo   install, then run the main job on the embedded SmolLM2 target
#   make test   install, then run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
OUT ?= runs/smollm2-drafter

.PHONY: setup demo test
setup:
	EYAS_VENV=$(VENV) bash scripts/setup.sh

demo: setup
	$(VENV)/bin/eyas new --target smollm2 --out $(OUT) --draft-vocab 8192
	$(VENV)/bin/eyas export $(OUT) --to vllm --out $(OUT)-vllm
	$(VENV)/bin/eyas info $(OUT)-vllm

test: setup
	$(PY) -m pytest -q
