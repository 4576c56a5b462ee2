#!/usr/bin/env bash
# Set up what the demo needs (scripts/setup.sh demo: once; later calls skip pip) and run `gefen demo` with any
# extra arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
.venv/bin/gefen demo "$@"
