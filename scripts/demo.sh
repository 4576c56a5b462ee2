#!/usr/bin/env bash
# Set up what the demo needs (scripts/setup.sh demo: once; later calls skip pip) and run `gefen demo` with any
# extra arguments.
set -euo pipefail
# The demo reports how long after this moment its first training step began (its "start_up" entry).
GEFEN_DEMO_LAUNCHED_AT="$(date +%s.%N)"
export GEFEN_DEMO_LAUNCHED_AT
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
.venv/bin/gefen demo "$@"
