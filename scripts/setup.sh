#!/usr/bin/env bash
# Usage: bash scripts/setup.sh [EXTRAS]    e.g. `bash scripts/setup.sh demo`, `bash scripts/setup.sh demo,test,hf,gates`
# Create .venv (if missing) and install gefen editable with the comma-separated pip EXTRAS (default: all of them:
# demo,test,hf,gates), pinned by constraints.txt (torch==2.13.0, the CPU build); pip also compiles the native
# library.
#
# Set-up is one-time: .venv/.gefen-setup records a hash of what the install depends on (pyproject.toml, setup.py,
# constraints.txt, build-constraints.txt, src/gefen/_version.py, the C sources, the venv's Python and this clone's
# path) and the extras installed with it. When the hash matches, the extras asked for are among those recorded and
# the native library that was built is still there, pip is not run at all (well under a second); otherwise pip
# runs and the record is rewritten. A changed C file therefore rebuilds the library on the next call. Several
# set-ups share one .venv: installing more extras keeps those already there (pip removes nothing), so the record
# keeps them too. Safe to run repeatedly; an interrupted install leaves no record, so the next call installs again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The extras, sorted and without duplicates: "test,demo" and "demo,test" are one set.
wanted=$(printf '%s\n' "${1:-demo,test,hf,gates}" | tr ',' '\n' | sed -e 's/[[:space:]]//g' -e '/^$/d' | sort -u)
[ -n "$wanted" ] || { echo "setup.sh: no extras given; e.g. bash scripts/setup.sh demo" >&2; exit 2; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv

stamp=.venv/.gefen-setup
library=src/gefen/kernels/libgefen_kernels.so
inputs=(pyproject.toml setup.py constraints.txt build-constraints.txt src/gefen/_version.py)
mapfile -t sources < <(find src/gefen/kernels/_native -type f \( -name '*.c' -o -name '*.h' \) | LC_ALL=C sort)
hash=$({ sha256sum "${inputs[@]}" "${sources[@]}"; .venv/bin/python -VV; pwd; } | sha256sum | cut -d' ' -f1)

# The record: line 1 "hash <hash>", line 2 "native yes|no" (whether pip built the library), then one extra a line.
recorded=""
if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "hash $hash" ]; then
  recorded=$(sed -n '3,$p' "$stamp")
  if [ "$(sed -n 2p "$stamp")" = "native yes" ] && [ ! -f "$library" ]; then
    recorded=""  # the library was deleted since (e.g. git clean): build it again
  fi
fi
missing=$(comm -23 <(printf '%s\n' "$wanted") <(printf '%s\n' "$recorded" | sed '/^$/d'))
if [ -z "$missing" ]; then
  echo "setup.sh: .venv is up to date for [$(paste -sd, - <<<"$wanted")] (pip skipped; $stamp)"
  exit 0
fi

rm -f "$stamp"
echo "setup.sh: installing gefen[$(paste -sd, - <<<"$wanted")] into .venv (pip; compiles the native library)"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".[$(paste -sd, - <<<"$wanted")]"
native=no
[ -f "$library" ] && native=yes
[ $native = yes ] || echo "setup.sh: WARNING: the native CPU kernels were not built (is a C compiler installed? see" \
  "'pip install -v -e .'); gefen will run its eager step on the CPU, slower, and warn once per optimizer" >&2
{
  echo "hash $hash"
  echo "native $native"
  printf '%s\n' "$wanted" "$recorded" | sed '/^$/d' | sort -u
} >"$stamp.partial"
mv "$stamp.partial" "$stamp"
