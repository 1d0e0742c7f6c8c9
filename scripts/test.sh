#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh), checks style (ruff) and layering (import-linter), and runs
# the whole test suite on CPU, printing its 15 slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check quire tests scripts
.venv/bin/lint-imports  # the layering contracts in pyproject.toml
exec .venv/bin/python -m pytest -q --durations=15 "$@"
