#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run `gefen demo` with any extra arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/gefen demo "$@"
