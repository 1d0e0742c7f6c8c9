#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
