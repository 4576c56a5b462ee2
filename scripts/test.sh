#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite plus the lint check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check src tests benchmarks
.venv/bin/python -m pytest "$@"
