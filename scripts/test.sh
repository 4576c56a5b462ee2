#!/usr/bin/env bash
# Set up what the tests need (scripts/setup.sh with the demo, test, hf and gates extras: once; later calls skip pip)
# and run the whole test suite plus the lint check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo,test,hf,gates
.venv/bin/python -m ruff check src tests benchmarks
.venv/bin/python -m pytest "$@"
