#!/usr/bin/env bash
# Create .venv (if missing) and install gefen with its demo and test extras, pinned by constraints.txt
# (torch==2.13.0, the CPU build). Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[demo,test,hf,gates]"
